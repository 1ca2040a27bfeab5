//! Writing a batch's results into its transaction: log rows of claims, placements,
//! quarantine and dead-letter records, handler effects and the meta counters. Nothing
//! here commits; the caller's transaction does (I1).

use super::*;

impl Shard {
    /// Begins a write transaction that commits with `Durability::Immediate`: every
    /// transaction of the shard starts here (I1), and fails with the same error.
    pub(super) fn durable_txn(&self) -> Result<WriteTransaction, LedgerError> {
        let mut txn = self.db.begin_write().map_err(|e| self.err(e))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| self.err(e))?;
        Ok(txn)
    }

    /// Commits a transaction from [`Shard::durable_txn`]; once this returns `Ok` its writes
    /// survive a crash. Counts the commit and returns how long it took. On `Err` nothing of
    /// the transaction is durable and the caller must stop the shard (I4).
    pub(super) fn commit_durably(
        &mut self,
        txn: WriteTransaction,
    ) -> Result<Duration, LedgerError> {
        let started = Instant::now();
        txn.commit().map_err(|e| self.err(e))?;
        let took = started.elapsed();
        metrics::histogram!(crate::telemetry::metric::COMMIT_DURATION_SECONDS, "shard" => self.ctx.index.to_string())
            .record(took.as_secs_f64());
        self.count_commit();
        Ok(took)
    }

    /// Counts a durable commit of this shard, and of the engine (`backends/tracked.rs`).
    pub(super) fn count_commit(&mut self) {
        self.undurable = false;
        self.ctx
            .engine_commits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.ctx
            .metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .commits += 1;
    }

    /// Writes what a batch decided: placements, claims (log rows), settled and new
    /// records, and handler effects. Durable with the batch's commit.
    pub(super) fn write_batch(
        &mut self,
        txn: &WriteTransaction,
        now: u64,
    ) -> Result<(), LedgerError> {
        self.write_placements(txn, now)?;
        self.write_logs(txn)?;
        // Before new records: a replay dead-lettered again is a new record, not a
        // repeat merged into the one it settles.
        self.remove_settled(txn)?;
        self.write_records(txn, RecordKind::Quarantine)?;
        self.write_handler_effects(txn, now)
    }

    /// Writes the effects of this batch's successful handler calls and its dead letters.
    pub(super) fn write_handler_effects(
        &mut self,
        txn: &WriteTransaction,
        now: u64,
    ) -> Result<(), LedgerError> {
        let path = self.ctx.path.clone();
        for st in self.subs.iter_mut().flatten() {
            let Some(view) = st.handling.view.take() else {
                continue;
            };
            let absorbed = view.finish();
            let outbox = absorbed.outbox;
            let rows = crate::ledger::records::outbox::write(
                txn,
                &st.name,
                &outbox,
                &mut self.next_outbox_seq,
                now,
            )
            .map_err(|e| storage(&path, e))?;
            if crate::ledger::records::outbox::warn_now(rows, self.outbox_warned) {
                self.outbox_warned = rows;
                tracing::warn!(shard = self.ctx.index, rows,
                    "outbox rows pile up: nothing consumes them (relay them to Kafka with [kafka.outbox], or pull and acknowledge them over HTTP: GET /v1/outbox, POST /v1/outbox/ack)");
            }
            if let Some(row) = absorbed.log_row {
                st.handling
                    .state_buf
                    .append_row(txn, &st.name, &row)
                    .map_err(|e| storage(&path, e))?;
            }
        }
        self.write_records(txn, RecordKind::DeadLetter).map(|_| ())
    }

    /// Records placements of this batch's claims that this shard had not recorded yet, so
    /// a restart knows to probe (`placement.rs`).
    pub(super) fn write_placements(
        &mut self,
        txn: &WriteTransaction,
        now: u64,
    ) -> Result<(), LedgerError> {
        let mut table = None;
        for st in self.subs.iter_mut().flatten() {
            if st.placement.mask_pending != 0 {
                record_key_source(&self.ctx, txn, st, now)?;
            }
            let new = st.placement.mask_pending & !st.placement.disk_mask;
            st.placement.mask_pending = 0;
            if new == 0 {
                continue;
            }
            if table.is_none() {
                table = Some(
                    txn.open_table(tables::PLACEMENTS)
                        .map_err(|e| storage(&self.ctx.path, e))?,
                );
            }
            if let Some(t) = table.as_mut() {
                t.insert(&*st.name, st.placement.disk_mask | new)
                    .map_err(|e| storage(&self.ctx.path, e))?;
            }
            st.placement.disk_mask |= new;
        }
        Ok(())
    }

    /// Appends this batch's claims as one row per subscriber to its active log, and records
    /// new active generations.
    pub(super) fn write_logs(&mut self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        let path = self.ctx.path.clone();
        let err = |e: redb::TableError| storage(&path, e);
        let serr = |e: redb::StorageError| storage(&path, e);
        for st in self.subs.iter_mut().flatten() {
            if LogRow::is_empty(&st.claims.pending_log) {
                continue;
            }
            let Some(active) = st.claims.active.as_mut() else {
                continue;
            };
            if active.next_row == 0 {
                let meta = GenMeta {
                    state: GenState::Active,
                    order: active.order,
                    count: 0,
                    max_expires_ms: 0,
                    created_at_ms: active.created_at_ms,
                };
                let mut gens = txn.open_table(tables::GENERATIONS).map_err(err)?;
                gens.insert((&*st.name, active.table_id), meta.encode().as_slice())
                    .map_err(serr)?;
            }
            let name = tables::log_name(&st.name, active.table_id);
            let mut t = txn.open_table(log_def(&name)).map_err(err)?;
            t.insert(active.next_row, st.claims.pending_log.as_slice())
                .map_err(serr)?;
            active.next_row += 1;
            LogRow::start(&mut st.claims.pending_log);
        }
        Ok(())
    }

    /// Removes the records that replayed jobs settled in this batch.
    pub(super) fn remove_settled(&mut self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        for (kind, sub, seq) in std::mem::take(&mut self.settled) {
            let idx = self.sub_index(sub)?;
            if let Some(st) = self.subs[idx].as_mut() {
                remove_record(txn, &self.ctx.path, st, kind, seq)?;
            }
        }
        Ok(())
    }

    /// Stores this batch's quarantine or dead-letter rows, merging repeats (see `records/`).
    pub(super) fn write_records(
        &mut self,
        txn: &WriteTransaction,
        kind: RecordKind,
    ) -> Result<Vec<u64>, LedgerError> {
        let (rows, next_seq) = match kind {
            RecordKind::Quarantine => (&mut self.quarantine_rows, &mut self.next_quarantine_seq),
            RecordKind::DeadLetter => (&mut self.dead_rows, &mut self.next_dead_seq),
        };
        records::store(
            txn,
            kind,
            rows,
            next_seq,
            &mut self.subs,
            records::Limits::of(&self.ctx.config, self.ctx.count),
            &self.ctx.registry,
        )
        .map_err(|e| storage(&self.ctx.path, e))
    }

    pub(super) fn write_counters(&self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        let mut meta = txn.open_table(tables::META).map_err(|e| self.err(e))?;
        meta.insert(tables::meta::NEXT_TABLE_ID, self.next_table_id)
            .map_err(|e| self.err(e))?;
        meta.insert(tables::meta::NEXT_QUARANTINE_SEQ, self.next_quarantine_seq)
            .map_err(|e| self.err(e))?;
        meta.insert(tables::meta::NEXT_OUTBOX_SEQ, self.next_outbox_seq)
            .map_err(|e| self.err(e))?;
        meta.insert(tables::meta::NEXT_DEAD_SEQ, self.next_dead_seq)
            .map_err(|e| self.err(e))?;
        // The high-water mark of engine time: the next start never begins below it.
        meta.insert(tables::meta::ENGINE_TIME_MS, self.ctx.clock.now_ms())
            .map_err(|e| self.err(e))?;
        Ok(())
    }
}

/// The subscriber wrote claims in this batch: records the key source they were made with
/// (when this shard's record says another) and how long they live, so a key source change
/// is refused while they do (`check_key_source`).
fn record_key_source(
    ctx: &ShardContext,
    txn: &WriteTransaction,
    st: &mut SubState,
    now: u64,
) -> Result<(), LedgerError> {
    let Some(spec) = ctx.registry.get(st.id) else {
        return Ok(());
    };
    spec.note_claims(
        &st.placement.key_source,
        now.saturating_add(st.claims.ttl_ms),
    );
    if st.placement.key_source_on_disk.as_deref() == Some(&*st.placement.key_source) {
        return Ok(());
    }
    let mut t = txn
        .open_table(tables::KEY_SOURCES)
        .map_err(|e| storage(&ctx.path, e))?;
    t.insert(&*st.name, &*st.placement.key_source)
        .map_err(|e| storage(&ctx.path, e))?;
    st.placement.key_source_on_disk = Some(st.placement.key_source.clone());
    Ok(())
}

/// Deletes one quarantine or dead-letter record of a subscriber (the outcome stays counted).
pub(super) fn remove_record(
    txn: &WriteTransaction,
    path: &std::path::Path,
    st: &mut SubState,
    kind: RecordKind,
    seq: u64,
) -> Result<bool, LedgerError> {
    records::remove(txn, st, kind, seq).map_err(|e| storage(path, e))
}
