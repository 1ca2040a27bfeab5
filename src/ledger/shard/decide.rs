//! One batch: each job decided against the newest record of its key (I2), the handler
//! called for new messages, and the claims, records and effects of the batch written and
//! committed in one durable transaction (I1). Kept apart from maintenance so the path
//! every message takes reads top to bottom.

use super::open::{apply_settings, new_sub_state};
use super::*;

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
                st.probe = placement::needs_probe(
                    spec.placements.load(Ordering::Acquire) | st.disk_mask,
                    self.ctx.count,
                );
            }
            let current = st.handler.as_ref().map(|h| &h.factory);
            let same = match (current, &want) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            };
            if same {
                continue;
            }
            st.handler = want.map(|factory| {
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
        let mut txn = self.db.begin_write().map_err(|e| self.err(e))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| LedgerError::Storage {
                path: self.ctx.path.clone(),
                detail: e.to_string(),
            })?;
        let t0 = Instant::now();
        let mut decisions = Vec::with_capacity(jobs.len());
        let mut wrote = false;
        let presize = self.ctx.config.generation_max_claims.get();
        // Per-subscriber counters of this batch, indexed by subscriber id:
        // processed, duplicates, quarantined, probes, false positives, refreshes,
        // dead-lettered, retries.
        let mut counts: Vec<[u64; 8]> = Vec::new();
        {
            let mut open: HashMap<u64, redb::Table<u128, [u8; CLAIM_LEN]>> = HashMap::new();
            for job in jobs {
                let idx = self.sub_index(job.subscriber)?;
                if counts.len() <= idx {
                    counts.resize(idx + 1, [0; 8]);
                }
                let c = &mut counts[idx];
                let st = self.subs[idx].as_mut().ok_or_else(|| {
                    LedgerError::InvalidSubscriber("subscriber state missing".into())
                })?;
                let existing = match st.find_in_memory(job.key) {
                    Found::Active(r) | Found::Older(r) => Some(r),
                    Found::AskSealed => {
                        let mut hit = None;
                        for g in st.sealed.iter().rev() {
                            c[3] += 1;
                            if !g.filter.may_contain(job.key) {
                                continue;
                            }
                            let table = match open.entry(g.table_id) {
                                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                                std::collections::hash_map::Entry::Vacant(v) => {
                                    let name = tables::claims_name(&st.name, g.table_id);
                                    v.insert(
                                        txn.open_table(claims_def(&name))
                                            .map_err(|e| storage(&self.ctx.path, e))?,
                                    )
                                }
                            };
                            match table.get(job.key).map_err(|e| storage(&self.ctx.path, e))? {
                                Some(v) => {
                                    hit = Some(ClaimRecord::decode(&v.value()));
                                    break;
                                }
                                None => c[4] += 1,
                            }
                        }
                        hit
                    }
                };
                // No live claim here: the subscriber's claims may be on other shards too
                // (`placement.rs`). Ask them first, holding the key in flight.
                let existing = match (&job.probed, existing) {
                    (_, Some(r)) if r.is_live(now) => Some(r),
                    (Some(elsewhere), here) => ClaimRecord::newer(here, *elsewhere),
                    (None, _) if st.probe => {
                        let d =
                            match self
                                .ctx
                                .inflight
                                .acquire(job.subscriber, job.key, self.ctx.index)
                            {
                                Acquire::Taken => Decision::Probe,
                                Acquire::Busy => Decision::Wait,
                            };
                        decisions.push(d);
                        continue;
                    }
                    (None, here) => here,
                };
                let decision = match existing {
                    Some(r) if r.is_live(now) && r.fingerprint == job.fingerprint => {
                        if st.sliding {
                            let refreshed = ClaimRecord {
                                expires_at_ms: now.saturating_add(st.ttl_ms),
                                ..r
                            };
                            insert_claim(
                                st,
                                &mut self.next_table_id,
                                job.key,
                                refreshed,
                                now,
                                presize,
                                &mut self.spare_maps,
                            );
                            c[5] += 1;
                            st.mask_pending |=
                                placement_bit(job, self.ctx.index, self.ctx.count, &st.name);
                            wrote = true;
                        }
                        c[1] += 1;
                        Decision::Done(Outcome::Duplicate)
                    }
                    Some(r) if r.is_live(now) && !job.replace => {
                        self.quarantine_rows
                            .push(records::quarantine(st, job, r.fingerprint, now));
                        st.quarantined += 1;
                        c[2] += 1;
                        wrote = true;
                        Decision::Done(Outcome::Quarantined {
                            stored_fingerprint: r.fingerprint,
                        })
                    }
                    _ => {
                        // New. With a handler, the claim commits only with its effects.
                        let handled = match st.handler.as_mut() {
                            None => Ok(0),
                            Some(h) => {
                                let view = match st.view.take() {
                                    Some(v) => v,
                                    None => {
                                        st.state_buf.tend_marks(&self.db, &st.name);
                                        Box::new(
                                            BatchView::open(&self.db, &st.name, &st.state_buf)
                                                .map_err(|e| storage(&self.ctx.path, e))?,
                                        )
                                    }
                                };
                                // Reuses the previous message's buffers.
                                let msg = &mut self.handler_msg;
                                msg.subscriber.clear();
                                msg.subscriber.push_str(&st.name);
                                msg.id.clear();
                                msg.id.push_str(&job.id);
                                msg.key.clone_from(&job.partition_key);
                                msg.headers.clone_from(&job.headers);
                                msg.payload.clear();
                                msg.payload.extend_from_slice(&job.payload);
                                msg.attempt = job.attempt;
                                msg.received_at_ms = job.received_at_ms;
                                let mut view = view;
                                view.set_scope(job.entity.as_deref());
                                let (mut view, result) = h.instance.handle(msg, view);
                                let version = h.factory.version();
                                let handled = result.map(|effects| {
                                    view.absorb(effects);
                                    version
                                });
                                st.view = Some(view);
                                handled
                            }
                        };
                        if let Err(f) = &handled {
                            let kind = f.kind();
                            if let (Some(i), Some(spec)) = (
                                crate::ledger::HANDLER_FAILURE_KINDS
                                    .iter()
                                    .position(|k| *k == kind),
                                self.ctx.registry.get(job.subscriber),
                            ) {
                                spec.counters.handler_failures[i].fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        match handled {
                            Ok(handler_version) => {
                                let claim = ClaimRecord {
                                    fingerprint: job.fingerprint,
                                    processed_at_ms: now,
                                    expires_at_ms: now.saturating_add(st.ttl_ms),
                                    handler_version,
                                };
                                insert_claim(
                                    st,
                                    &mut self.next_table_id,
                                    job.key,
                                    claim,
                                    now,
                                    presize,
                                    &mut self.spare_maps,
                                );
                                c[0] += 1;
                                st.mask_pending |=
                                    placement_bit(job, self.ctx.index, self.ctx.count, &st.name);
                                wrote = true;
                                Decision::Done(Outcome::Processed)
                            }
                            Err(f) if f.is_retryable() && job.attempt < st.max_attempts => {
                                c[7] += 1;
                                Decision::Retry(f)
                            }
                            Err(f) => {
                                let reason =
                                    format!("{f} (attempt {} of {})", job.attempt, st.max_attempts);
                                self.dead_rows
                                    .push(records::dead_letter(st, job, &f, &reason, now));
                                st.dead_lettered += 1;
                                c[6] += 1;
                                wrote = true;
                                Decision::Done(Outcome::DeadLettered {
                                    reason,
                                    attempts: job.attempt,
                                })
                            }
                        }
                    }
                };
                if let (Some((kind, seq)), Decision::Done(outcome)) = (job.settle, &decision) {
                    if !matches!(outcome, Outcome::Quarantined { .. }) {
                        self.settled.push((kind, job.subscriber, seq));
                        wrote = true;
                    }
                }
                decisions.push(decision);
            }
        }
        let t1 = Instant::now();
        if wrote {
            self.write_placements(&txn)?;
            self.write_logs(&txn)?;
            // Before new records: a replay dead-lettered again is a new record, not a
            // repeat merged into the one it settles.
            self.remove_settled(&txn)?;
            self.write_quarantine(&txn)?;
            self.write_handler_effects(&txn, now)?;
        }
        // A view holds a snapshot of this batch; the next batch reads a fresh one.
        for st in self.subs.iter_mut().flatten() {
            st.view = None;
        }
        let t2 = Instant::now();
        let budget = slice_budget(jobs.len());
        let maintenance = self.maintenance(&txn, now, budget, false)?;
        let t3 = Instant::now();
        self.request_spare_map();
        if wrote || maintenance {
            self.write_counters(&txn)?;
            let started = Instant::now();
            txn.commit().map_err(|e| self.err(e))?;
            metrics::histogram!("dedupd_commit_duration_seconds", "shard" => self.ctx.index.to_string())
                .record(started.elapsed().as_secs_f64());
            let mut m = self.ctx.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.commits += 1;
            m.max_commit_us = m.max_commit_us.max(started.elapsed().as_micros() as u64);
            let total = t0.elapsed();
            if total > Duration::from_millis(40) {
                tracing::debug!(
                    shard = self.ctx.index,
                    jobs = jobs.len(),
                    decide_ms = (t1 - t0).as_millis() as u64,
                    log_ms = (t2 - t1).as_millis() as u64,
                    maintenance_ms = (t3 - t2).as_millis() as u64,
                    commit_ms = started.elapsed().as_millis() as u64,
                    "slow batch"
                );
            }
        } else {
            txn.abort().map_err(|e| self.err(e))?;
        }
        for (id, c) in counts.into_iter().enumerate() {
            if c == [0; 8] {
                continue;
            }
            if let Some(spec) = self.ctx.registry.get(SubscriberId(id as u32)) {
                let k = &spec.counters;
                k.processed.fetch_add(c[0], Ordering::Relaxed);
                k.duplicates.fetch_add(c[1], Ordering::Relaxed);
                k.quarantined.fetch_add(c[2], Ordering::Relaxed);
                k.filter_probes.fetch_add(c[3], Ordering::Relaxed);
                k.filter_false_positives.fetch_add(c[4], Ordering::Relaxed);
                k.sliding_refreshes.fetch_add(c[5], Ordering::Relaxed);
                k.dead_lettered.fetch_add(c[6], Ordering::Relaxed);
                k.retries.fetch_add(c[7], Ordering::Relaxed);
            }
        }
        Ok((decisions, maintenance))
    }

    pub(super) fn lookup(
        &mut self,
        sub: SubscriberId,
        key: u128,
    ) -> Result<Option<ClaimRecord>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        Ok(self
            .newest_record(sub, key, &mut None)?
            .filter(|r| !r.is_tombstone()))
    }

    /// The newest record of a key in this shard, live, expired or tombstone (I2). `txn`
    /// is opened on the first sealed-generation read and reused by the caller's next call.
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
        match st.find_in_memory(key) {
            Found::Active(r) | Found::Older(r) => Ok(Some(r)),
            Found::AskSealed => {
                for g in st.sealed.iter().rev() {
                    if !g.filter.may_contain(key) {
                        continue;
                    }
                    if txn.is_none() {
                        *txn = Some(self.db.begin_read().map_err(|e| self.err(e))?);
                    }
                    let Some(t) = txn.as_ref() else { continue };
                    let name = tables::claims_name(&st.name, g.table_id);
                    let t = t.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
                    if let Some(v) = t.get(key).map_err(|e| self.err(e))? {
                        return Ok(Some(ClaimRecord::decode(&v.value())));
                    }
                }
                Ok(None)
            }
        }
    }
}

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

/// Records a claim in the active generation (creating it if needed) and in the batch's
/// log row. Durable only once the batch commits.
/// The index is allocated at full size up front (growing a half-million-entry hash table
/// inside a batch was a measured 20-60 ms stall), preferably from the spare pool.
pub(super) fn insert_claim(
    st: &mut SubState,
    next_table_id: &mut u64,
    key: u128,
    claim: ClaimRecord,
    now: u64,
    presize: usize,
    spare: &mut Vec<KeyMap>,
) {
    let active = st.active.get_or_insert_with(|| {
        let id = *next_table_id;
        *next_table_id += 1;
        let order = st.next_order;
        st.next_order += 1;
        ActiveGen {
            table_id: id,
            order,
            map: spare
                .pop()
                .unwrap_or_else(|| KeyMap::with_capacity_and_hasher(presize, Default::default())),
            next_row: 0,
            created_at_ms: now,
        }
    });
    active.map.insert(key, claim);
    LogRow::push(&mut st.pending_log, key, &claim);
}
