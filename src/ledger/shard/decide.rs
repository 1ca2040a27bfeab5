//! One batch: each job decided against the newest record of its key (I2), the handler
//! called for new messages, and the claims, records and effects of the batch written and
//! committed in one durable transaction (I1). Kept apart from maintenance so the path
//! every message takes reads top to bottom.

use super::open::{apply_settings, new_sub_state};
use super::tally::{BatchCounts, Tally};
use super::*;
use crate::ledger::placement::presence::PresenceWriter;
use crate::ledger::Work;

impl Shard {
    #[inline]
    pub(super) fn sub_index(&mut self, id: SubscriberId) -> Result<usize, LedgerError> {
        let idx = id.0 as usize;
        if matches!(self.subs.get(idx), Some(Some(_))) {
            return Ok(idx);
        }
        if self.subs.len() <= idx {
            self.subs.resize_with(idx + 1, || None);
        }
        if self.subs[idx].is_none() {
            let spec = self.ctx.registry.get(id).ok_or_else(|| {
                LedgerError::InvalidSubscriber(format!("unknown subscriber id {}", id.0))
            })?;
            let st = new_sub_state(&spec, &self.db).map_err(|e| self.err(e))?;
            self.subs[idx] = Some(st);
        }
        Ok(idx)
    }

    /// Brings each subscriber of this batch up to date with its handler in the registry:
    /// a new or replaced handler takes effect here, between batches, never inside one.
    fn sync_handlers(&mut self, jobs: &[Job]) -> Result<(), LedgerError> {
        let mut seen: Vec<SubscriberId> = Vec::new();
        for job in jobs {
            if !seen.contains(&job.subscriber) {
                seen.push(job.subscriber);
            }
        }
        for id in seen {
            let idx = self.sub_index(id)?;
            let spec = self.ctx.registry.get(id);
            let want = spec.as_ref().and_then(|s| s.handler());
            let Some(st) = self.subs[idx].as_mut() else {
                continue;
            };
            if let Some(spec) = &spec {
                if spec.settings_epoch() != st.settings_epoch {
                    apply_settings(st, spec);
                }
                st.placement.probe = placement::needs_probe(
                    spec.placements.load(Ordering::Acquire) | st.placement.disk_mask,
                    self.ctx.count,
                );
                if st.placement.probe && st.placement.presence.is_none() {
                    st.placement.presence = Some(start_presence(st, &self.ctx));
                }
                st.changelog.set(spec.changelog());
            }
            let current = st.handling.handler.as_ref().map(|h| &h.factory);
            let same = match (current, &want) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            };
            if same {
                continue;
            }
            st.handling.breaker = Default::default();
            st.handling.handler = want.map(|factory| {
                let instance = factory.instantiate().unwrap_or_else(|e| {
                    tracing::error!(shard = self.ctx.index, subscriber = %st.name, error = %e,
                        "handler cannot be instantiated; its messages fail and are dead-lettered");
                    Box::new(Unavailable(format!("handler cannot be instantiated: {e}")))
                });
                ShardHandler { factory, instance }
            });
        }
        Ok(())
    }
    /// Decides every job of a batch, runs handlers for new messages, writes claims and
    /// handler effects, runs a slice of maintenance, and commits durably. On `Err` nothing
    /// of this batch is durable and the shard must stop.
    pub(super) fn commit_batch(
        &mut self,
        jobs: &[Job],
        now: u64,
    ) -> Result<(Vec<Decision>, bool), LedgerError> {
        self.sync_handlers(jobs)?;
        let txn = self.durable_txn()?;
        // The thread's scheduler figures, for the "slow batch" line: how much of a slow
        // batch was spent waiting for a core that other work held.
        let sched0 = tracing::enabled!(tracing::Level::DEBUG)
            .then(crate::telemetry::sched::thread)
            .flatten();
        let t0 = Instant::now();
        let mut tally = Tally::default();
        let mut decisions = Vec::with_capacity(jobs.len());
        {
            let mut sealed = SealedTables::new(&txn, &self.ctx.path);
            for job in jobs.iter().take(PREFETCH_AHEAD) {
                self.prefetch_filters(job);
            }
            for (i, job) in jobs.iter().enumerate() {
                if let Some(ahead) = jobs.get(i + PREFETCH_AHEAD) {
                    self.prefetch_filters(ahead);
                }
                decisions.push(self.decide(job, now, &mut sealed, &mut tally)?);
            }
        }
        // Published before the commit: the local ledger never holds a processed message
        // its changelog lacks (`changelog.rs`). The acknowledgements are awaited after the
        // batch is written into the transaction and maintenance ran, just before commit.
        let mut published = self.publish_changes()?;
        let t1 = Instant::now();
        if tally.wrote {
            self.write_batch(&txn, now)?;
        }
        // A view holds a snapshot of this batch; the next batch reads a fresh one. Its
        // effects are in the shard's buffer already, and in the log row written above:
        // every absorbed call sets `tally.wrote`.
        for st in self.subs.iter_mut().flatten() {
            if let Some(view) = st.handling.view.take() {
                debug_assert!(
                    view.finish().log_row.is_none(),
                    "a batch's handler effects were not written"
                );
            }
        }
        let t2 = Instant::now();
        // In proportion to the batch, unless maintenance is behind (`gap_maintenance`).
        let budget = slice_budget(jobs.len(), self.maintenance_behind());
        let maintenance = self.maintenance(&txn, now, budget, false)?;
        published.extend(self.publish_records()?);
        for (subscriber, p) in published {
            p.wait().map_err(|e| LedgerError::Changelog {
                subscriber,
                detail: e.to_string(),
            })?;
        }
        let t3 = Instant::now();
        self.request_spare_map();
        if tally.wrote || maintenance {
            self.write_counters(&txn)?;
            let commit = self.commit_durably(txn)?;
            let mut m = self.ctx.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.max_commit_us = m.max_commit_us.max(commit.as_micros() as u64);
            drop(m);
            if t0.elapsed() > Duration::from_millis(40) {
                let sched = crate::telemetry::sched::thread_since(sched0);
                tracing::debug!(
                    shard = self.ctx.index,
                    jobs = jobs.len(),
                    running_ms = sched.running_ns / 1_000_000,
                    waiting_for_a_core_ms = sched.waiting_ns / 1_000_000,
                    decide_ms = (t1 - t0).as_millis() as u64,
                    log_ms = (t2 - t1).as_millis() as u64,
                    maintenance_ms = (t3 - t2).as_millis() as u64,
                    commit_ms = commit.as_millis() as u64,
                    "slow batch"
                );
            }
        } else {
            txn.abort().map_err(|e| self.err(e))?;
        }
        tally.publish(&self.ctx.registry);
        Ok((decisions, maintenance))
    }

    /// Starts loading the sealed-generation filter slots `decide` will read for `job`: a new
    /// key is probed in every sealed generation (three cache misses each once the filters
    /// outgrow the caches, 16 % of a 100M-claim run), so the batch asks for them
    /// `PREFETCH_AHEAD` jobs early.
    fn prefetch_filters(&self, job: &Job) {
        if !matches!(job.work, Work::Deliver | Work::Replay { .. }) {
            return;
        }
        if let Some(Some(st)) = self.subs.get(job.subscriber.0 as usize) {
            for g in &st.claims.sealed {
                g.filter.prefetch(job.key);
            }
            if st.placement.probe && job.probed.is_none() {
                self.ctx
                    .presences
                    .prefetch_others(self.ctx.index, job.subscriber, job.key);
            }
        }
    }

    /// Decides one job of the batch against the newest record of its key (I2) and, for a
    /// new message, its handler's result. What it decides is written by `write_batch`.
    fn decide(
        &mut self,
        job: &Job,
        now: u64,
        sealed: &mut SealedTables<'_>,
        tally: &mut Tally,
    ) -> Result<Decision, LedgerError> {
        let idx = self.sub_index(job.subscriber)?;
        match &job.work {
            Work::Restore(change) => return self.restore(idx, job, change, now, tally),
            Work::Snapshot(items) => return self.snapshot(idx, items),
            Work::Deliver | Work::Replay { .. } => {}
        }
        let st = self.subs[idx]
            .as_mut()
            .ok_or_else(|| LedgerError::InvalidSubscriber("subscriber state missing".into()))?;
        let counts = tally.of(idx);
        let here = newest_record_in(st, job.key, counts, |sub, id| sealed.get(sub, id, job.key))?;
        // No live claim here: the subscriber's claims may be on other shards too
        // (`placement.rs`). Ask them first, holding the key in flight.
        let existing = match (&job.probed, here) {
            (_, Some(r)) if r.is_live(now) => Some(r),
            (Some(elsewhere), here) => ClaimRecord::newer(here, *elsewhere),
            (None, here) if st.placement.probe => {
                match self
                    .ctx
                    .inflight
                    .acquire(job.subscriber, job.key, self.ctx.index)
                {
                    Acquire::Busy => return Ok(Decision::Wait),
                    // Every other shard's presence says it holds no record of the key:
                    // decided here without the round trip (`presence.rs`); the key is
                    // given back once this batch committed.
                    Acquire::Taken
                        if self.ctx.presences.others_lack(
                            self.ctx.index,
                            job.subscriber,
                            job.key,
                        ) =>
                    {
                        self.held_unprobed.push((job.subscriber, job.key));
                        here
                    }
                    Acquire::Taken => return Ok(Decision::Probe),
                }
            }
            (None, here) => here,
        };
        let decision = match existing {
            Some(r) if r.is_live(now) && r.fingerprint == job.fingerprint => {
                if st.claims.sliding {
                    let refreshed = ClaimRecord {
                        expires_at_ms: now.saturating_add(st.claims.ttl_ms),
                        ..r
                    };
                    self.claim(idx, job, refreshed, now);
                    tally.of(idx).sliding_refreshes += 1;
                    tally.wrote = true;
                }
                tally.of(idx).duplicates += 1;
                Decision::Done(Outcome::Duplicate)
            }
            Some(r) if r.is_live(now) && !job.work.replaces() => {
                self.quarantine_rows
                    .push(records::quarantine(st, job, r.fingerprint, now));
                st.records.quarantined += 1;
                tally.of(idx).quarantined += 1;
                tally.wrote = true;
                Decision::Done(Outcome::Quarantined {
                    stored_fingerprint: r.fingerprint,
                })
            }
            _ if self.shares.holds_back(idx, Instant::now) => {
                tally.of(idx).calls_deferred += 1;
                Decision::Defer
            }
            _ => {
                let handled = match self.breaker_refuses(idx, now, tally) {
                    Some(refused) => Err(refused),
                    None => {
                        let handled = self.call_handler(idx, job)?;
                        self.breaker_record(idx, &handled, now, tally);
                        handled
                    }
                };
                self.settle_handled(idx, job, handled, now, tally)?
            }
        };
        if let (Some((kind, seq)), Decision::Done(outcome)) = (job.work.settles(), &decision) {
            if !matches!(outcome, Outcome::Quarantined { .. }) {
                self.settled.push((kind, job.subscriber, seq));
                tally.wrote = true;
            }
        }
        Ok(decision)
    }

    /// Records a claim of `job` in memory and in the batch's log row, with the placement
    /// bit it needs (durable once the batch commits).
    pub(super) fn claim(&mut self, idx: usize, job: &Job, claim: ClaimRecord, now: u64) {
        let presize = self.ctx.config.full_index_claims();
        if let Some(st) = self.subs[idx].as_mut() {
            insert_claim(
                st,
                &mut self.next_table_id,
                job.key,
                claim,
                now,
                presize,
                &mut self.spare_maps,
            );
            st.placement.mask_pending |=
                placement_bit(job, self.ctx.index, self.ctx.count, &st.name);
        }
    }

    /// The newest record of a key in this shard, live, expired or tombstone (I2), for
    /// lookups and other shards' probes. `txn` is opened on the first sealed-generation
    /// read and reused by the caller's next call.
    pub(super) fn newest_record(
        &mut self,
        sub: SubscriberId,
        key: u128,
        txn: &mut Option<redb::ReadTransaction>,
    ) -> Result<Option<ClaimRecord>, LedgerError> {
        let idx = self.sub_index(sub)?;
        let Some(st) = self.subs[idx].as_ref() else {
            return Ok(None);
        };
        let (db, path) = (&self.db, &self.ctx.path);
        // Only a batch's lookups are counted.
        let mut uncounted = BatchCounts::default();
        newest_record_in(st, key, &mut uncounted, |sub, id| {
            if txn.is_none() {
                *txn = Some(db.begin_read().map_err(|e| storage(path, e))?);
            }
            let Some(t) = txn.as_ref() else {
                return Ok(None);
            };
            let name = tables::claims_name(sub, id);
            let t = t
                .open_table(claims_def(&name))
                .map_err(|e| storage(path, e))?;
            block::lookup(&t, key).map_err(|e| block_error(path, &name, e))
        })
    }
}

/// The subscriber's view for this batch (a replayed change or a snapshot; a handler call,
/// which holds the handler borrowed, takes it the same way inline): the one its earlier
/// messages used, or a fresh one over its buffers and runs. Give it back
/// (`st.handling.view = Some(..)`) when done.
pub(super) fn batch_view(
    st: &mut SubState,
    db: &redb::Database,
    path: &std::path::Path,
) -> Result<Box<dyn StateReader>, LedgerError> {
    match st.handling.view.take() {
        Some(v) => Ok(v),
        None => Ok(Box::new(
            BatchView::open(db, &st.name, &st.handling.state_buf).map_err(|e| storage(path, e))?,
        )),
    }
}

/// Starts publishing what this shard holds of a subscriber whose claims the other shards
/// probe for (`presence.rs`): once set, every record written is in it.
pub(super) fn start_presence(st: &SubState, ctx: &ShardContext) -> PresenceWriter {
    PresenceWriter::start(
        &ctx.presences,
        ctx.index,
        st.id,
        st.claims.active.as_ref().map(|a| a.map.keys().copied()),
        st.claims.sealing.as_ref().map(|s| s.map.keys().copied()),
        SubClaims::sealed_filters(&st.claims.sealed),
    )
}

/// The newest record of `key` for one subscriber on this shard, live, expired or
/// tombstone (I2): the in-memory generations (active, then sealing), then the sealed ones
/// newest first, each behind its filter. `read(subscriber, generation)` reads the key
/// from a sealed generation's table. The one lookup that a batch's decisions, lookups and
/// other shards' probes share.
fn newest_record_in(
    st: &SubState,
    key: u128,
    counts: &mut BatchCounts,
    mut read: impl FnMut(&str, u64) -> Result<Option<ClaimRecord>, LedgerError>,
) -> Result<Option<ClaimRecord>, LedgerError> {
    match st.claims.find_in_memory(key) {
        Found::Active(r) | Found::Older(r) => Ok(Some(r)),
        Found::AskSealed => {
            for g in st.claims.sealed.iter().rev() {
                counts.filter_probes += 1;
                if !g.filter.may_contain(key) {
                    continue;
                }
                match read(&st.name, g.table_id)? {
                    Some(r) => return Ok(Some(r)),
                    None => counts.filter_false_positives += 1,
                }
            }
            Ok(None)
        }
    }
}

/// The sealed-generation tables a batch read, kept open for the rest of the batch.
pub(super) struct SealedTables<'t> {
    txn: &'t WriteTransaction,
    path: PathBuf,
    open: HashMap<u64, redb::Table<'t, u128, &'static [u8]>>,
}

impl<'t> SealedTables<'t> {
    fn new(txn: &'t WriteTransaction, path: &std::path::Path) -> Self {
        SealedTables {
            txn,
            path: path.to_path_buf(),
            open: HashMap::new(),
        }
    }

    fn get(&mut self, sub: &str, id: u64, key: u128) -> Result<Option<ClaimRecord>, LedgerError> {
        let table = match self.open.entry(id) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let name = tables::claims_name(sub, id);
                v.insert(
                    self.txn
                        .open_table(claims_def(&name))
                        .map_err(|e| storage(&self.path, e))?,
                )
            }
        };
        block::lookup(table, key)
            .map_err(|e| block_error(&self.path, &tables::claims_name(sub, id), e))
    }
}

/// How many jobs ahead of the one being decided a batch prefetches filter slots.
const PREFETCH_AHEAD: usize = 4;

/// The placement bit a claim of `job` written on `shard` records: its placement's, or
/// [`placement::ANYWHERE`] when the job was decided away from the shard its placement
/// chooses.
fn placement_bit(job: &Job, shard: usize, count: usize, subscriber: &str) -> u8 {
    let home = match job.placement {
        Placement::ByKey => job.key,
        Placement::Subscriber => crate::envelope::key_hash(subscriber.as_bytes()),
        Placement::Entity => {
            crate::envelope::key_hash(job.entity.as_deref().unwrap_or_default().as_bytes())
        }
    };
    if crate::ledger::route_hash(home, count) == shard {
        job.placement.bit()
    } else {
        placement::ANYWHERE
    }
}

/// Capacity of a new generation's index.
const FIRST_INDEX_CAPACITY: usize = 1 << 6;
/// An index holding at least this many claims that must grow moves into a full-size one
/// instead.
const MOVE_TO_FULL_AT: usize = 1 << 13;

/// Records a claim in the active generation (creating it if needed) and in the batch's
/// log row. Durable only once the batch commits. A new generation's index starts small
/// and moves into a full-size one from the spare pool once it is busy ([`make_room`]:
/// growing a half-million-entry hash table inside a batch was a measured 20-60 ms stall).
pub(super) fn insert_claim(
    st: &mut SubState,
    next_table_id: &mut u64,
    key: u128,
    claim: ClaimRecord,
    now: u64,
    presize: usize,
    spare: &mut Vec<KeyMap>,
) {
    let active = st.claims.active.get_or_insert_with(|| {
        let id = *next_table_id;
        *next_table_id += 1;
        let order = st.claims.next_order;
        st.claims.next_order += 1;
        ActiveGen {
            table_id: id,
            order,
            // Small first: an index grows with its claims, so a quiet subscriber costs
            // kilobytes, not a full generation's index (issue 13).
            map: KeyMap::with_capacity_and_hasher(
                FIRST_INDEX_CAPACITY.min(presize),
                Default::default(),
            ),
            next_row: 0,
            created_at_ms: now,
        }
    });
    make_room(&mut active.map, presize, spare);
    active.map.insert(key, claim);
    LogRow::push(&mut st.claims.pending_log, key, &claim);
    // Before the batch commits and gives the key back to the in-flight set.
    if let Some(p) = st.placement.presence.as_mut() {
        let sealed = &st.claims.sealed;
        p.insert(key, || SubClaims::sealed_filters(sealed));
    }
}

/// Before an insert into a full index: growing a large table in place rehashes it during a
/// batch (a latency spike, and twice the memory for a moment), so a busy subscriber moves
/// once into a full-size index that was faulted in off the hot path (`request_spare_map`).
/// While none is ready and the index is still small, it grows in place (a rehash of at
/// most a quarter of a generation, a few milliseconds): allocating the full size inside the
/// batch instead faults its ~45 MB in there, which at start, before the builder's first
/// spare arrived, held both shards' first batches for 430 ms.
fn make_room(map: &mut KeyMap, presize: usize, spare: &mut Vec<KeyMap>) {
    if map.len() < MOVE_TO_FULL_AT || map.len() < map.capacity() || map.capacity() >= presize {
        return;
    }
    let full = match spare.pop() {
        Some(full) => full,
        None if map.capacity() < presize / 4 => return,
        None => KeyMap::with_capacity_and_hasher(presize, Default::default()),
    };
    let mut full = full;
    full.extend(map.drain());
    *map = full;
}

#[cfg(test)]
mod tests {
    use super::{make_room, KeyMap, MOVE_TO_FULL_AT};
    use crate::config::LedgerConfig;
    use crate::ledger::claims::generation::{map_bytes, resident_map};
    use crate::ledger::claims::record::ClaimRecord;
    use std::num::NonZeroUsize;

    const C: ClaimRecord = ClaimRecord {
        fingerprint: 0,
        processed_at_ms: 0,
        expires_at_ms: 0,
        handler_version: 0,
    };

    fn full_index(n: usize) -> KeyMap {
        let mut m = KeyMap::with_capacity_and_hasher(n, Default::default());
        let mut k = 0u128;
        while m.len() < m.capacity() {
            k += 1;
            m.insert(k, C);
        }
        m
    }

    /// A generation seals after the batch that filled it, so its index takes up to one
    /// batch more. Sized for the generation alone, a generation size at 7/8 of a power of
    /// two (458,752 = 7/8 of 2^19) rehashed into twice the slots inside that last batch.
    #[test]
    fn a_full_index_takes_the_batch_that_fills_its_generation_without_growing() {
        for claims in [458_752, 440_000, 1 << 19, 1_000] {
            let cfg = LedgerConfig {
                generation_max_claims: NonZeroUsize::new(claims).unwrap(),
                ..LedgerConfig::default()
            };
            let mut map = resident_map(cfg.full_index_claims());
            let (capacity, bytes) = (map.capacity(), map_bytes(&map));
            let mut k = 0u128;
            while map.len() < claims - 1 + cfg.max_batch.get() {
                k += 1;
                map.insert(k, C);
            }
            assert_eq!(
                map.capacity(),
                capacity,
                "{claims}: the last batch rehashed"
            );
            assert_eq!(map_bytes(&map), bytes);
        }
        // The default fills 2^19 slots of 49 bytes (24.5 MiB), not 2^20.
        let default = resident_map(LedgerConfig::default().full_index_claims());
        assert_eq!(map_bytes(&default), (1 << 19) * 49);
    }

    #[test]
    fn a_small_full_index_grows_in_place_until_a_spare_is_ready() {
        let presize = 1 << 19;
        let mut spare = Vec::new();
        let mut map = full_index(MOVE_TO_FULL_AT);
        let before = map.capacity();
        make_room(&mut map, presize, &mut spare);
        // No full-size allocation inside the batch: the insert that follows doubles it.
        assert_eq!(map.capacity(), before);
        map.insert(u128::MAX, C);
        assert!(map.capacity() < presize / 2, "{}", map.capacity());

        // A spare is taken as soon as there is one, with every claim moved.
        let mut map = full_index(MOVE_TO_FULL_AT);
        let n = map.len();
        spare.push(KeyMap::with_capacity_and_hasher(
            presize,
            Default::default(),
        ));
        make_room(&mut map, presize, &mut spare);
        assert!(map.capacity() >= presize && spare.is_empty());
        assert_eq!(map.len(), n);

        // A large index moves to the full size even without a spare (one more in-place
        // doubling would be the stall the spare avoids).
        let mut map = full_index(presize / 4);
        make_room(&mut map, presize, &mut spare);
        assert!(map.capacity() >= presize);
    }
}
