//! Maintenance between and inside batches: sealing full or old active generations,
//! merging small sealed ones (the merge itself is in `merge.rs`), dropping expired ones, trimming retired logs and sweeping
//! records past their retention. Bounded by a row budget per transaction so a batch
//! stays short; the sealed table, filter and `Sealed` row commit together (I3).

use super::*;

impl Shard {
    /// Work between batches when the queue is empty: finish sealing and merging sooner.
    pub(super) fn idle(&mut self) {
        if self.failed.is_some() || !self.has_pending_work(false) {
            return;
        }
        let now = self.ctx.clock.now_ms();
        if let Err(e) = self.maintenance_txn(now, IDLE_SLICE, false) {
            self.poison(e);
        }
    }

    /// Maintenance in the gaps between batches: while no message waits (no jobs, no
    /// control request, no peer), slices of [`GAP_SLICE`] entries in
    /// transactions of their own, committed with `Durability::None`. They change no claim
    /// (S1), cost no fsync, and are made durable by the next batch's commit (a crash before
    /// it only loses work that is done again); a message that arrives meanwhile waits for
    /// one slice at most. When nothing is left, one durable commit makes the gaps' work
    /// durable (and lets redb free the pages they released, which only durable commits do).
    ///
    /// So batches carry maintenance only in proportion to their size (twice their jobs),
    /// unless maintenance is behind ([`Shard::maintenance_behind`]): at half of the capacity
    /// the batches are small, and each carried a slice of at least 8,192 entries before
    /// (p99 227 ms). Measured at 45,000 msgs/s with the shipping-label handler, two
    /// alternating pairs: p99 51 and 147 ms this way, 207 and 516 ms when only batches
    /// after a gap were light (at that load the queue is rarely empty after a batch).
    pub(super) fn gap_maintenance(&mut self, rx: &Receiver<ShardMsg>, peers: &Receiver<PeerMsg>) {
        while self.failed.is_none()
            && rx.is_empty()
            && peers.is_empty()
            && self.has_pending_work(false)
        {
            let now = self.ctx.clock.now_ms();
            match self.maintenance_txn_as(now, GAP_SLICE, false, Durability::None) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    self.poison(e);
                    return;
                }
            }
        }
        if self.undurable && self.failed.is_none() && rx.is_empty() {
            // Nothing else to do: make the gaps' work durable (small_commit poisons the
            // shard itself if it fails).
            let _ = self.small_commit(|_, _| Ok(()));
        }
    }

    /// Whether maintenance has fallen behind what comes in: a subscriber's state buffer
    /// is full while the previous one is still being written, or its active generation is
    /// due to seal while the previous one is still sealing. Batches then carry at least
    /// [`BEHIND_SLICE`] of maintenance, whatever their size.
    pub(super) fn maintenance_behind(&self) -> bool {
        let cfg = &self.ctx.config;
        let now = self.ctx.clock.now_ms();
        self.subs.iter().flatten().any(|st| {
            (st.handling.state_buf.frozen.is_some()
                && st.handling.state_buf.active_len() >= cfg.state_buffer_entries.get())
                || (st.claims.sealing.is_some()
                    && st
                        .claims
                        .active
                        .as_ref()
                        .is_some_and(|a| due_to_seal(a, cfg, now, false)))
                || st.claims.sealed.len() > 2 * cfg.merge_trigger_generations.get()
        }) || self.retired_claims.len() > 4
    }

    pub(super) fn has_pending_work(&self, seal_all: bool) -> bool {
        let now = self.ctx.clock.now_ms();
        let cfg = &self.ctx.config;
        let expiry_due = now.saturating_sub(self.last_expiry_check_ms) >= EXPIRY_CHECK_MS;
        !self.retired_logs.is_empty()
            || !self.retired_claims.is_empty()
            || records::sweep_due(&self.subs, now)
            || self.subs.iter().flatten().any(|st| {
                st.handling
                    .state_buf
                    .has_work(cfg.state_buffer_entries.get())
                    || st.claims.sealing.is_some()
                    || st.claims.merging.is_some()
                    || st.claims.sealed.len() > cfg.merge_trigger_generations.get()
                    || (expiry_due && st.claims.sealed.iter().any(|g| g.max_expires_ms <= now))
                    || st
                        .claims
                        .active
                        .as_ref()
                        .is_some_and(|a| due_to_seal(a, cfg, now, seal_all))
            })
    }

    /// One durable transaction of maintenance only.
    fn maintenance_txn(
        &mut self,
        now: u64,
        budget: usize,
        seal_all: bool,
    ) -> Result<bool, LedgerError> {
        self.maintenance_txn_as(now, budget, seal_all, Durability::Immediate)
    }

    /// One transaction of maintenance only, committed with `durability`.
    fn maintenance_txn_as(
        &mut self,
        now: u64,
        budget: usize,
        seal_all: bool,
        durability: Durability,
    ) -> Result<bool, LedgerError> {
        let started = Instant::now();
        let mut txn = self.durable_txn()?;
        txn.set_durability(durability).map_err(|e| self.err(e))?;
        let did = self.maintenance(&txn, now, budget, seal_all)?;
        if did {
            self.publish_records_now()?;
            self.write_counters(&txn)?;
            txn.commit().map_err(|e| self.err(e))?;
            // Only durable commits count (an online backup cuts its copies at them).
            self.undurable = matches!(durability, Durability::None);
            if matches!(durability, Durability::Immediate) {
                metrics::histogram!(crate::telemetry::metric::COMMIT_DURATION_SECONDS, "shard" => self.ctx.index.to_string())
                    .record(started.elapsed().as_secs_f64());
                self.count_commit();
            }
            let mut m = self.ctx.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.max_batch_us_maintenance = m
                .max_batch_us_maintenance
                .max(started.elapsed().as_micros() as u64);
        } else {
            txn.abort().map_err(|e| self.err(e))?;
        }
        Ok(did)
    }

    /// Sealing, merging and expiry, bounded by `budget` rows written. Returns whether it
    /// wrote anything (the caller then commits).
    pub(super) fn maintenance(
        &mut self,
        txn: &WriteTransaction,
        now: u64,
        budget: usize,
        seal_all: bool,
    ) -> Result<bool, LedgerError> {
        let started = Instant::now();
        let mut did = false;
        while let Ok(built) = self.built_rx.try_recv() {
            self.attach_built(built);
        }
        let expiry_due = now.saturating_sub(self.last_expiry_check_ms) >= EXPIRY_CHECK_MS;
        if expiry_due {
            self.last_expiry_check_ms = now;
        }
        let cfg = self.ctx.config.clone();
        // Handler state work (flushes, merges, retired runs) of all subscribers shares one
        // budget per transaction, taken in turn: with one budget each, three subscribers
        // filling in step did up to nine slices in one batch (166 ms seen in the demo).
        let mut state_budget = budget.saturating_mul(STATE_SLICES);
        let n = self.subs.len().max(1);
        let first = self.next_state_turn % n;
        self.next_state_turn = self.next_state_turn.wrapping_add(1);
        for idx in (first..self.subs.len()).chain(0..first) {
            let Some(mut st) = self.subs[idx].take() else {
                continue;
            };
            let r = self.maintain_sub(
                &mut st,
                txn,
                now,
                (budget, &mut state_budget),
                seal_all,
                expiry_due,
                &cfg,
            );
            self.subs[idx] = Some(st);
            did |= r?;
        }
        let t_subs = Instant::now();
        if records::sweep_due(&self.subs, now) {
            // A sweep outside a batch tombstones what it removes in the changelog too.
            for idx in 0..self.subs.len() {
                self.refresh_changelog(idx);
            }
        }
        did |= records::sweep(
            txn,
            &mut self.subs,
            now,
            records::Limits::of(&cfg, self.ctx.count),
            &self.ctx.registry,
        )
        .map_err(|e| self.err(e))?;
        let in_batch = budget < IDLE_SLICE;
        let defer = in_batch && !self.trims_deferred && t_subs - started >= TRIM_DEFER_AFTER;
        self.trims_deferred = defer;
        if !defer {
            did |= self.trim_retired_log(txn, if in_batch { RETIRE_ROWS } else { 64 })?;
        }
        let t_log = Instant::now();
        if !defer {
            did |= self.trim_retired_claims(txn, budget.saturating_mul(RETIRE_FACTOR))?;
        }
        let t_end = Instant::now();
        if t_end - t_subs > Duration::from_millis(15) {
            tracing::debug!(
                shard = self.ctx.index,
                records_and_retired_logs_ms = (t_log - t_subs).as_millis() as u64,
                retired_claims_ms = (t_end - t_log).as_millis() as u64,
                "slow maintenance outside subscribers"
            );
        }
        Ok(did)
    }

    /// Empties key ranges of the oldest retired claims table until about `budget` claims
    /// are removed; deletes the table once every range is empty.
    fn trim_retired_claims(
        &mut self,
        txn: &WriteTransaction,
        budget: usize,
    ) -> Result<bool, LedgerError> {
        // Counted in claims: a block holds about this many.
        const CLAIMS_PER_BLOCK: usize = 128;
        let mut removed = 0usize;
        let mut did = false;
        // A table that fits in what is left of the budget is deleted whole (deleting reads
        // each of its pages once), and the next one is taken: one table per transaction
        // fell behind when generations are small and many (a soak with 2,048-claim
        // generations queued 600 tables in 40 s and its files grew by 7 MB/s).
        while let Some(front) = self.retired_claims.front() {
            let cost = (front.claims as usize).max(CLAIMS_PER_BLOCK);
            if front.next != 0 || cost > budget - removed {
                break;
            }
            txn.delete_table(claims_def(&front.name))
                .map_err(|e| self.err(e))?;
            removed += cost;
            self.retired_claims.pop_front();
            did = true;
        }
        if removed >= budget {
            return Ok(did);
        }
        let Some(RetiredClaims { name, next, .. }) = self.retired_claims.front_mut() else {
            return Ok(did);
        };
        {
            let mut t = txn
                .open_table(claims_def(name))
                .map_err(|e| storage(&self.ctx.path, e))?;
            while *next < RETIRE_RANGES && removed < budget {
                let lo = u128::from(*next) << 119;
                let r = if *next + 1 == RETIRE_RANGES {
                    t.retain_in(lo.., |_, _| {
                        removed += CLAIMS_PER_BLOCK;
                        false
                    })
                } else {
                    t.retain_in(lo..lo + (1u128 << 119), |_, _| {
                        removed += CLAIMS_PER_BLOCK;
                        false
                    })
                };
                r.map_err(|e| storage(&self.ctx.path, e))?;
                *next += 1;
            }
        }
        if *next == RETIRE_RANGES {
            let name = name.clone();
            txn.delete_table(claims_def(&name))
                .map_err(|e| self.err(e))?;
            self.retired_claims.pop_front();
        }
        Ok(true)
    }

    /// One subscriber's maintenance: its handler state buffer, then sealing, expiry and
    /// merging of its generations. Returns whether it wrote anything.
    #[allow(
        clippy::too_many_arguments,
        reason = "the parts of one run, passed once"
    )]
    fn maintain_sub(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        now: u64,
        (budget, state_budget): (usize, &mut usize),
        seal_all: bool,
        expiry_due: bool,
        cfg: &LedgerConfig,
    ) -> Result<bool, LedgerError> {
        // Step times for the "slow maintenance" debug line, taken only when it can print.
        let timed = tracing::enabled!(tracing::Level::DEBUG);
        let stamp = || timed.then(Instant::now);
        let sched0 = timed.then(crate::telemetry::sched::thread).flatten();
        let t0 = stamp();
        let mut did = st
            .handling
            .state_buf
            .maintain(
                &self.db,
                txn,
                &st.name,
                cfg.state_buffer_entries.get(),
                state_budget,
                seal_all,
            )
            .map_err(|e| self.err(e))?;
        if st.claims.sealing.is_none()
            && st
                .claims
                .active
                .as_ref()
                .is_some_and(|a| due_to_seal(a, cfg, now, seal_all))
        {
            did |= self.seal_active(st, txn, now)?;
        }
        let t1 = stamp();
        did |= self.seal_slice(st, txn, budget)?;
        let t2 = stamp();
        if expiry_due {
            did |= self.drop_expired(st, txn, now)?;
        }
        let t3 = stamp();
        did |= self.start_merge(st, cfg);
        if st.claims.merging.is_some() {
            did |= self.merge_step(st, txn, now, budget)?;
        }
        if let (Some(t0), Some(t1), Some(t2), Some(t3), Some(t4)) = (t0, t1, t2, t3, stamp()) {
            if t4 - t0 > Duration::from_millis(15) {
                let sched = crate::telemetry::sched::thread_since(sched0);
                tracing::debug!(shard = self.ctx.index, subscriber = %st.name,
                    running_ms = sched.running_ns / 1_000_000,
                    waiting_for_a_core_ms = sched.waiting_ns / 1_000_000,
                    state_and_seal_start_ms = (t1 - t0).as_millis() as u64,
                    seal_ms = (t2 - t1).as_millis() as u64,
                    expiry_ms = (t3 - t2).as_millis() as u64,
                    merge_ms = (t4 - t3).as_millis() as u64,
                    "slow maintenance of a subscriber");
            }
        }
        Ok(did)
    }

    /// Turns the active generation into the sealing one: its `Sealing` row is written here
    /// and the builder sorts it; its log stays until the sealed table commits (I3).
    fn seal_active(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        now: u64,
    ) -> Result<bool, LedgerError> {
        let Some(a) = st.claims.active.take() else {
            return Ok(false);
        };
        // Its Bloom filters move with it; the next active generation starts new ones.
        if let Some(p) = st.placement.presence.as_mut() {
            p.seal_active(SubClaims::sealed_filters(&st.claims.sealed));
        }
        let mut gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        let meta = GenMeta {
            state: GenState::Sealing,
            order: a.order,
            count: a.map.len() as u64,
            max_expires_ms: 0,
            created_at_ms: a.created_at_ms,
        };
        gens.insert((&*st.name, a.table_id), meta.encode().as_slice())
            .map_err(|e| self.err(e))?;
        drop(gens);
        let gen = SealingGen {
            table_id: a.table_id,
            order: a.order,
            created_at_ms: a.created_at_ms,
            map: Arc::new(a.map),
            built: None,
            pos: 0,
            extra_logs: Vec::new(),
        };
        self.start_sealing(st, gen, now);
        Ok(true)
    }

    /// Writes up to `budget` rows of the sealing generation's sorted table, once the
    /// builder sorted it; completes the generation when every row is written.
    fn seal_slice(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        budget: usize,
    ) -> Result<bool, LedgerError> {
        let Some(s) = st.claims.sealing.as_mut() else {
            return Ok(false);
        };
        let Some((entries, _)) = s.built.as_ref() else {
            return Ok(false);
        };
        let name = tables::claims_name(&st.name, s.table_id);
        let ts = Instant::now();
        // Whole blocks only, so a slice leaves nothing half-written between batches: the
        // last block of the generation is the only short one.
        let start = s.pos;
        let mut end = s.pos;
        {
            let mut t = txn.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
            let mut w = BlockWriter::default();
            for (i, (k, r)) in entries.iter().enumerate().skip(s.pos) {
                w.push(*k, r);
                let last = i + 1 == entries.len();
                if w.is_full() || last {
                    if let Some((key, block)) = w.take() {
                        t.insert(key, block.as_slice()).map_err(|e| self.err(e))?;
                    }
                    end = i + 1;
                    if end - start >= budget {
                        break;
                    }
                }
            }
        }
        tracing::trace!(
            claims = end - start,
            us = ts.elapsed().as_micros() as u64,
            done = end == entries.len(),
            "seal slice"
        );
        s.pos = end;
        if s.pos == entries.len() {
            self.finish_sealing(st, txn)?;
        }
        Ok(true)
    }

    /// Commits a completely written sealing generation as sealed (I3) and retires its
    /// log(s); its index goes back to the spare pool.
    fn finish_sealing(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
    ) -> Result<(), LedgerError> {
        let Some(s) = st.claims.sealing.as_mut() else {
            return Ok(());
        };
        let Some((entries, filter)) = s.built.as_ref() else {
            return Ok(());
        };
        let max_expires = entries.iter().map(|e| e.1.expires_at_ms).max().unwrap_or(0);
        let count = entries.len() as u64;
        let filter = filter.clone();
        tracing::info!(shard = self.ctx.index, subscriber = %st.name, claims = count,
            sealed_generations = st.claims.sealed.len() + 1, "generation sealed");
        let (table_id, order, created, extra) = (
            s.table_id,
            s.order,
            s.created_at_ms,
            std::mem::take(&mut s.extra_logs),
        );
        self.write_filter_row(txn, &st.name, table_id, &filter)?;
        self.commit_sealed(
            txn,
            st,
            SealedGen {
                table_id,
                order,
                count,
                max_expires_ms: max_expires,
                created_at_ms: created,
                filter: Arc::new(filter),
            },
        )?;
        if let Some(p) = st.placement.presence.as_mut() {
            p.sealed(SubClaims::sealed_filters(&st.claims.sealed));
        }
        let mut gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        for id in &extra {
            gens.remove((&*st.name, *id)).map_err(|e| self.err(e))?;
        }
        drop(gens);
        // The log is dead now (its generation row says Sealed); it is removed a
        // few rows per batch, since dropping it whole reads every page (~30 ms).
        for id in std::iter::once(table_id).chain(extra) {
            self.retired_logs.push_back(tables::log_name(&st.name, id));
        }
        if let Some(done) = st.claims.sealing.take() {
            if let Ok(mut map) = Arc::try_unwrap(done.map) {
                // Only full-size indexes are worth keeping: small ones belong to quiet
                // subscribers and would make a busy one grow in place. One spare is
                // enough (the next seal returns another); each is ~25-50 MB.
                let full = map.capacity() >= self.ctx.config.full_index_claims();
                if self.spare_maps.is_empty() && full {
                    map.clear();
                    self.spare_maps.push(map);
                }
            }
        }
        self.ctx
            .metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .seals += 1;
        Ok(())
    }

    /// Drops sealed generations whose every claim has expired (not those being merged).
    fn drop_expired(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        now: u64,
    ) -> Result<bool, LedgerError> {
        let mut did = false;
        let busy = st.claims.merging.as_ref().map(|m| (m.older, m.newer));
        let mut i = 0;
        while i < st.claims.sealed.len() {
            let g = &st.claims.sealed[i];
            let in_merge = busy.is_some_and(|(a, b)| g.table_id == a || g.table_id == b);
            if g.max_expires_ms <= now && !in_merge {
                let (id, claims) = (g.table_id, g.count);
                tracing::info!(shard = self.ctx.index, subscriber = %st.name, claims,
                    "expired generation dropped");
                self.delete_generation(txn, &st.name, id, claims)?;
                st.claims.sealed.remove(i);
                if let Some(p) = &st.placement.presence {
                    p.publish(SubClaims::sealed_filters(&st.claims.sealed));
                }
                self.ctx
                    .metrics
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .dropped_generations += 1;
                did = true;
            } else {
                i += 1;
            }
        }
        Ok(did)
    }

    /// Removes up to `rows` rows of the oldest retired log; drops the table once empty.
    fn trim_retired_log(
        &mut self,
        txn: &WriteTransaction,
        rows: usize,
    ) -> Result<bool, LedgerError> {
        let Some(name) = self.retired_logs.front().cloned() else {
            return Ok(false);
        };
        let empty = {
            let mut t = txn.open_table(log_def(&name)).map_err(|e| self.err(e))?;
            for _ in 0..rows {
                if t.pop_first().map_err(|e| self.err(e))?.is_none() {
                    break;
                }
            }
            t.is_empty().map_err(|e| self.err(e))?
        };
        if empty {
            txn.delete_table(log_def(&name)).map_err(|e| self.err(e))?;
            self.retired_logs.pop_front();
        }
        Ok(true)
    }

    /// Keeps one resident index ready for the next active generation: a fresh one only
    /// when no sealing generation will hand its index back (a third full-size index per
    /// shard was ~50 MB of resident memory for nothing), and reports the spare's size.
    pub(super) fn request_spare_map(&mut self) {
        let returning = self.subs.iter().flatten().any(|st| {
            st.claims
                .sealing
                .as_ref()
                .is_some_and(|s| s.map.capacity() >= self.ctx.config.full_index_claims())
        });
        if self.spare_maps.is_empty() && !self.map_requested && !returning {
            self.map_requested = self.ctx.builder.send(BuildJob::PrepareMap {
                capacity: self.ctx.config.full_index_claims(),
                reply: self.built_tx.clone(),
            });
        }
        let spare = self.spare_maps.iter().map(map_bytes).sum::<usize>() as u64;
        if spare != self.spare_bytes {
            self.spare_bytes = spare;
            self.ctx
                .metrics
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .spare_index_bytes = spare;
        }
    }

    /// Hands a full generation to the builder for sorting and filter construction; its
    /// index keeps answering lookups until the sealed table commits.
    pub(super) fn start_sealing(&self, st: &mut SubState, gen: SealingGen, now: u64) {
        let (table_id, map) = (gen.table_id, gen.map.clone());
        st.claims.sealing = Some(gen);
        let sent = self.ctx.builder.send(BuildJob::Seal {
            sub: st.id,
            table_id,
            map,
            now_ms: now,
            reply: self.built_tx.clone(),
        });
        if !sent {
            tracing::error!(
                shard = self.ctx.index,
                "generation builder is gone; sealing stalls"
            );
        }
    }

    fn attach_built(&mut self, built: Built) {
        match built {
            Built::Sealed {
                sub,
                table_id,
                entries,
                filter,
            } => {
                if let Some(Some(st)) = self.subs.get_mut(sub.0 as usize) {
                    if let Some(s) = st
                        .claims
                        .sealing
                        .as_mut()
                        .filter(|s| s.table_id == table_id)
                    {
                        s.built = Some((entries, filter));
                    }
                }
            }
            Built::Map(map) => {
                self.map_requested = false;
                self.spare_maps.push(map);
            }
        }
    }

    /// A sealed or merged generation's `filters_v1` row: in the transaction of its
    /// `Sealed` row for a seal, one transaction earlier for a merge (`merge.rs`).
    pub(super) fn write_filter_row(
        &self,
        txn: &WriteTransaction,
        sub: &str,
        table_id: u64,
        filter: &GenFilter,
    ) -> Result<(), LedgerError> {
        let mut filters = txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        filters
            .insert((sub, table_id), filter.encode().as_slice())
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Records a complete sorted table, whose filter row is written, as a sealed
    /// generation: its `Sealed` row in this transaction (I3), and its place in the recency
    /// order in memory.
    pub(super) fn commit_sealed(
        &self,
        txn: &WriteTransaction,
        st: &mut SubState,
        gen: SealedGen,
    ) -> Result<(), LedgerError> {
        let meta = GenMeta {
            state: GenState::Sealed,
            order: gen.order,
            count: gen.count,
            max_expires_ms: gen.max_expires_ms,
            created_at_ms: gen.created_at_ms,
        };
        let mut gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        gens.insert((&*st.name, gen.table_id), meta.encode().as_slice())
            .map_err(|e| self.err(e))?;
        let pos = st.claims.sealed.partition_point(|g| g.order < gen.order);
        st.claims.sealed.insert(pos, gen);
        Ok(())
    }

    pub(super) fn delete_generation(
        &mut self,
        txn: &WriteTransaction,
        sub: &str,
        id: u64,
        claims: u64,
    ) -> Result<(), LedgerError> {
        // The table itself is emptied by later slices (`trim_retired_claims`).
        self.retired_claims.push_back(RetiredClaims {
            name: tables::claims_name(sub, id),
            claims,
            next: 0,
        });
        let mut filters = txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        filters.remove((sub, id)).map_err(|e| self.err(e))?;
        let mut gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        gens.remove((sub, id)).map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Runs maintenance transactions until no sealing, merging or expiry work is left.
    pub(super) fn maintain_fully(&mut self, seal_all: bool) -> Result<(), LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut first = seal_all;
        loop {
            let now = self.ctx.clock.now_ms();
            self.last_expiry_check_ms = 0;
            let did = match self.maintenance_txn(now, IDLE_SLICE, first) {
                Ok(d) => d,
                Err(e) => {
                    self.poison(e.clone());
                    return Err(e);
                }
            };
            first = false;
            let waiting = self
                .subs
                .iter()
                .flatten()
                .any(|s| s.claims.sealing.as_ref().is_some_and(|g| g.built.is_none()));
            if waiting {
                if let Ok(b) = self.built_rx.recv_timeout(Duration::from_secs(60)) {
                    self.attach_built(b);
                }
                continue;
            }
            if !did {
                return Ok(());
            }
        }
    }
}

/// Whether an active generation is due to be sealed: full, old, or all are being sealed.
/// Only once its claims are in its log (`next_row > 0`): sealing writes the `Sealing` row
/// and the log is what survives a crash until the sealed table commits (I3), so a
/// generation whose claims were never logged must not start sealing.
fn due_to_seal(a: &ActiveGen, cfg: &LedgerConfig, now: u64, seal_all: bool) -> bool {
    a.next_row > 0
        && !a.map.is_empty()
        && (seal_all
            || a.map.len() >= cfg.generation_max_claims.get()
            || now.saturating_sub(a.created_at_ms) >= cfg.generation_max_age.as_millis() as u64)
}
