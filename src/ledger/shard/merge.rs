//! Merging two neighbouring sealed generations of a subscriber into one, slice by slice
//! inside maintenance transactions: both sorted tables are read from a cursor, merged with
//! expired claims dropped, and written to a new table with its filter built key by key;
//! once both are consumed, one transaction writes the filter's row and the next records
//! the new table and deletes the two inputs, so a lookup sees either both inputs or the
//! merged table.

use super::*;

impl Shard {
    /// Starts merging the smallest pair of neighbouring sealed generations when there are
    /// too many, so lookups probe few generations.
    pub(super) fn start_merge(&mut self, st: &mut SubState, cfg: &LedgerConfig) -> bool {
        if st.claims.merging.is_some()
            || st.claims.sealed.len() <= cfg.merge_trigger_generations.get()
        {
            return false;
        }
        let limit = cfg.merge_max_claims.get() as u64;
        let pick = (0..st.claims.sealed.len().saturating_sub(1))
            .map(|i| (st.claims.sealed[i].count + st.claims.sealed[i + 1].count, i))
            .filter(|(n, _)| *n <= limit)
            .min();
        let Some((_, i)) = pick else {
            return false;
        };
        let out_table = self.next_table_id;
        self.next_table_id += 1;
        let at_most = st.claims.sealed[i].count + st.claims.sealed[i + 1].count;
        st.claims.merging = Some(MergeJob {
            older: st.claims.sealed[i].table_id,
            newer: st.claims.sealed[i + 1].table_id,
            out_table,
            cursor_older: None,
            cursor_newer: None,
            older_done: false,
            newer_done: false,
            filter_builder: Some(FilterBuilder::for_at_most(at_most as usize)),
            writer: BlockWriter::default(),
            count: 0,
            max_expires_ms: 0,
            filter: None,
            filter_recorded: false,
        });
        true
    }

    /// One slice of a merge, or its completion once every claim is written.
    pub(super) fn merge_step(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        now: u64,
        budget: usize,
    ) -> Result<bool, LedgerError> {
        let Some(m) = st.claims.merging.as_mut() else {
            return Ok(false);
        };
        // The finished output's filter row goes one transaction before the finish: a
        // filter of a 4M-claim merge is one redb value of ~8 MB, and its insert (1-3 ms
        // usually, 8-32 ms in about one finish of three) with the inputs' deletion made
        // the finish the slowest batch at 100M claims. Until the finish commits, the row
        // belongs to an unfinished output: nothing reads it, and `recover` deletes it with
        // the output's table after a crash.
        match (&m.filter, m.filter_recorded) {
            (Some(filter), false) => {
                let started = std::time::Instant::now();
                self.write_filter_row(txn, &st.name, m.out_table, filter)?;
                m.filter_recorded = true;
                tracing::debug!(shard = self.ctx.index, subscriber = %st.name,
                    ms = started.elapsed().as_millis() as u64, "merged filter recorded");
                Ok(true)
            }
            (Some(_), true) => self.finish_merge(st, txn),
            (None, _) => self.copy_merge_slice(st, txn, now, budget),
        }
    }

    /// Once every claim of the merged table is written: replaces the two input generations
    /// by the merged one. Returns whether it wrote anything.
    fn finish_merge(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
    ) -> Result<bool, LedgerError> {
        let Some(m) = st.claims.merging.as_mut() else {
            return Ok(false);
        };
        let Some(filter) = m.filter.take() else {
            return Ok(false);
        };
        let (older, newer, out) = (m.older, m.newer, m.out_table);
        let oi = st.claims.sealed.iter().position(|g| g.table_id == older);
        let ni = st.claims.sealed.iter().position(|g| g.table_id == newer);
        let (Some(oi), Some(ni)) = (oi, ni) else {
            st.claims.merging = None;
            return Ok(false);
        };
        let order = st.claims.sealed[ni].order;
        let created = st.claims.sealed[oi].created_at_ms;
        let (older_claims, newer_claims) = (st.claims.sealed[oi].count, st.claims.sealed[ni].count);
        let count = m.count;
        let max_expires = m.max_expires_ms;
        let started = std::time::Instant::now();
        self.delete_generation(txn, &st.name, older, older_claims)?;
        self.delete_generation(txn, &st.name, newer, newer_claims)?;
        let deleted = started.elapsed();
        st.claims
            .sealed
            .retain(|g| g.table_id != older && g.table_id != newer);
        self.commit_sealed(
            txn,
            st,
            SealedGen {
                table_id: out,
                order,
                count,
                max_expires_ms: max_expires,
                created_at_ms: created,
                filter: Arc::new(filter),
            },
        )?;
        st.claims.merging = None;
        if let Some(p) = &st.placement.presence {
            p.publish(SubClaims::sealed_filters(&st.claims.sealed));
        }
        tracing::info!(shard = self.ctx.index, subscriber = %st.name, claims = count, delete_ms = deleted.as_millis() as u64,
            finish_ms = started.elapsed().as_millis() as u64, "generations merged");
        self.ctx
            .metrics
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .merges += 1;
        Ok(true)
    }

    /// Merges the next slice of both inputs (at most `budget` claims read) into the output
    /// table and its filter, dropping expired claims; once both inputs are consumed, the
    /// filter is complete.
    fn copy_merge_slice(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        now: u64,
        budget: usize,
    ) -> Result<bool, LedgerError> {
        let Some(m) = st.claims.merging.as_mut() else {
            return Ok(false);
        };
        let half = (budget / 2).max(1);
        let t0 = std::time::Instant::now();
        let older = tables::claims_name(&st.name, m.older);
        let (a, a_ex) = self.read_after(txn, &older, m.cursor_older, m.older_done, half)?;
        let newer = tables::claims_name(&st.name, m.newer);
        let (b, b_ex) = self.read_after(txn, &newer, m.cursor_newer, m.newer_done, half)?;
        let t1 = std::time::Instant::now();
        let (out, i, j) = merge_slice(&a, a_ex, &b, b_ex, now);
        if i > 0 {
            m.cursor_older = Some(a[i - 1].0);
        }
        if j > 0 {
            m.cursor_newer = Some(b[j - 1].0);
        }
        m.older_done = a_ex && i == a.len();
        m.newer_done = b_ex && j == b.len();
        let finished = m.older_done && m.newer_done;
        {
            // Full blocks are written as they fill; the last, short one once both inputs
            // are consumed. A restart deletes an unfinished output and merges again.
            let name = tables::claims_name(&st.name, m.out_table);
            let mut t = txn.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
            for (k, r) in &out {
                m.writer.push(*k, r);
                m.max_expires_ms = m.max_expires_ms.max(r.expires_at_ms);
                if let Some(f) = m.filter_builder.as_mut() {
                    f.insert(*k);
                }
                if m.writer.is_full() {
                    if let Some((key, block)) = m.writer.take() {
                        t.insert(key, block.as_slice()).map_err(|e| self.err(e))?;
                    }
                }
            }
            if finished {
                if let Some((key, block)) = m.writer.take() {
                    t.insert(key, block.as_slice()).map_err(|e| self.err(e))?;
                }
            }
        }
        let t2 = std::time::Instant::now();
        if t2 - t0 > std::time::Duration::from_millis(15) {
            tracing::debug!(
                shard = self.ctx.index,
                read_ms = (t1 - t0).as_millis() as u64,
                write_ms = (t2 - t1).as_millis() as u64,
                claims = out.len(),
                "slow merge slice"
            );
        }
        m.count += out.len() as u64;
        if finished {
            m.filter = m.filter_builder.take().map(FilterBuilder::finish);
        }
        Ok(true)
    }

    /// Up to `limit` claims of a sealed table after `cursor` (from the first when `None`),
    /// and whether the table is exhausted with them.
    fn read_after(
        &self,
        txn: &WriteTransaction,
        name: &str,
        cursor: Option<u128>,
        done: bool,
        limit: usize,
    ) -> Result<(Vec<(u128, ClaimRecord)>, bool), LedgerError> {
        if done {
            return Ok((Vec::new(), true));
        }
        let t = txn.open_table(claims_def(name)).map_err(|e| self.err(e))?;
        block::read_after(&t, cursor, limit).map_err(|e| block_error(&self.ctx.path, name, e))
    }
}
