//! Control requests answered between batches on the writer thread: lookups, forced
//! maintenance, reports, handler state dumps, forgetting claims, record pages and
//! deletion, the outbox and backups. Writes go through one durable transaction each
//! ([`Shard::small_commit`]); a failure stops the shard like a failed batch (I4).

use super::decide::insert_claim;
use super::write::remove_record;
use super::*;

impl Shard {
    pub(super) fn control(&mut self, c: Control) {
        match c {
            Control::Sync { reply } => {
                let _ = reply.send(Ok(()));
            }
            Control::Lookup { sub, key, reply } => {
                let r = match &self.failed {
                    Some(e) => Err(e.clone()),
                    None => self.newest_record(sub, key, &mut None),
                };
                let _ = reply.send(r);
            }
            Control::Maintain { seal_all, reply } => {
                let _ = reply.send(self.maintain_fully(seal_all));
            }
            Control::Report { reply } => {
                let _ = reply.send(Ok(self.report()));
            }
            Control::StateLen { subscriber, reply } => {
                let r = self.with_flushed_state(&subscriber, |db, buf| {
                    state::state_len(db, &subscriber, buf)
                });
                let _ = reply.send(r);
            }
            Control::StateEntries { subscriber, reply } => {
                let r = self.with_flushed_state(&subscriber, |db, buf| {
                    state::state_entries(db, &subscriber, buf)
                });
                let _ = reply.send(r);
            }
            Control::Forget { sub, key, reply } => {
                let _ = reply.send(self.forget(sub, key));
            }
            Control::DeleteRecord {
                kind,
                sub,
                seq,
                reply,
            } => {
                let _ = reply.send(self.delete_record(kind, sub, seq));
            }
            Control::AddDeadLetter { sub, row, reply } => {
                let _ = reply.send(self.add_dead_letter(sub, row));
            }
            Control::OutboxPending { limit, reply } => {
                let _ = reply.send(self.outbox_pending(limit));
            }
            Control::OutboxAck { seqs, reply } => {
                let _ = reply.send(self.outbox_ack(seqs));
            }
            Control::OutboxWrite {
                subscriber,
                messages,
                reply,
            } => {
                let _ = reply.send(self.outbox_write(&subscriber, &messages));
            }
            Control::RecordsRestore { sub, copies, reply } => {
                let _ = reply.send(self.records_restore(sub, copies));
            }
            Control::OutboxLen { reply } => {
                let _ = reply.send(self.outbox_len());
            }
            Control::OutboxSpan { reply } => {
                let _ = reply.send(self.outbox_span());
            }
            Control::Checkpoint { key, reply } => {
                let _ = reply.send(self.checkpoint(&key));
            }
            Control::SetCheckpoints { entries, reply } => {
                let _ = reply.send(self.set_checkpoints(&entries));
            }
            Control::BackupBegin { reply } => {
                let r = match &self.failed {
                    Some(e) => Err(e.clone()),
                    None => {
                        self.ctx.writes.start();
                        Ok(self.ctx.path.clone())
                    }
                };
                let _ = reply.send(r);
            }
            Control::BackupFinish {
                dest,
                meeting,
                reply,
            } => {
                let _ = reply.send(self.finish_backup(dest.as_deref(), &meeting));
            }
        }
    }

    /// One durable transaction outside a batch (between batches, on the writer thread).
    /// A failure stops the shard like a failed batch (I4).
    pub(super) fn small_commit<T>(
        &mut self,
        work: impl FnOnce(&mut Self, &WriteTransaction) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = (|| -> Result<T, LedgerError> {
            let txn = self.durable_txn()?;
            let out = work(self, &txn)?;
            // Records it stored or removed are in their changelogs before it commits.
            self.publish_records_now()?;
            self.write_counters(&txn)?;
            txn.commit().map_err(|e| self.err(e))?;
            self.count_commit();
            Ok(out)
        })();
        if let Err(e) = &result {
            self.abandon_batch();
            self.poison(e.clone());
        }
        result
    }

    /// Writes a subscriber's buffered handler effects into a run, then reads its runs
    /// whole with `read` (state dump, counts).
    fn with_flushed_state<T>(
        &mut self,
        subscriber: &str,
        read: impl FnOnce(&Database, &StateBuffer) -> Result<T, redb::Error>,
    ) -> Result<T, LedgerError> {
        let spec = self.ctx.registry.resolve(subscriber, true)?;
        let idx = self.sub_index(spec.id)?;
        self.flush_state(idx)?;
        let r = match self.subs[idx].as_ref() {
            Some(st) => read(&self.db, &st.handling.state_buf),
            None => StateBuffer::load(&self.db, subscriber).and_then(|b| read(&self.db, &b)),
        };
        r.map_err(|e| self.err(e))
    }

    /// Writes a subscriber's buffered handler effects into a run.
    fn flush_state(&mut self, idx: usize) -> Result<(), LedgerError> {
        let threshold = self.ctx.config.state_buffer_entries.get();
        if self.subs[idx]
            .as_ref()
            .is_none_or(|st| st.handling.state_buf.is_empty())
        {
            return Ok(());
        }
        self.small_commit(|shard, txn| {
            let db = shard.db.clone();
            let Some(st) = shard.subs[idx].as_mut() else {
                return Ok(());
            };
            st.handling
                .state_buf
                .flush_all(&db, txn, &st.name, threshold)
                .map(|_| ())
                .map_err(|e| storage(&shard.ctx.path, e))
        })
    }

    /// The newest claim of a key in this shard, not counting tombstones.
    fn lookup(&mut self, sub: SubscriberId, key: u128) -> Result<Option<ClaimRecord>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        Ok(self
            .newest_record(sub, key, &mut None)?
            .filter(|r| !r.is_tombstone()))
    }

    /// Writes a tombstone over a live claim so the next delivery is processed again.
    fn forget(&mut self, sub: SubscriberId, key: u128) -> Result<bool, LedgerError> {
        let now = self.ctx.clock.now_ms();
        let Some(claim) = self.lookup(sub, key)?.filter(|r| r.is_live(now)) else {
            return Ok(false);
        };
        let idx = self.sub_index(sub)?;
        let presize = self.ctx.config.generation_max_claims.get();
        if let Some(st) = self.subs[idx].as_mut() {
            insert_claim(
                st,
                &mut self.next_table_id,
                key,
                ClaimRecord::tombstone_of(&claim, now),
                now,
                presize,
                &mut self.spare_maps,
            );
        }
        self.small_commit(|shard, txn| shard.write_logs(txn))?;
        Ok(true)
    }

    fn delete_record(
        &mut self,
        kind: RecordKind,
        sub: SubscriberId,
        seq: u64,
    ) -> Result<bool, LedgerError> {
        let idx = self.sub_index(sub)?;
        self.refresh_changelog(idx);
        self.small_commit(|shard, txn| match shard.subs[idx].as_mut() {
            Some(st) => remove_record(txn, &shard.ctx.path, st, kind, seq),
            None => Ok(false),
        })
    }

    fn records_restore(
        &mut self,
        sub: SubscriberId,
        copies: Vec<crate::ledger::changelog::RecordCopy>,
    ) -> Result<u64, LedgerError> {
        let idx = self.sub_index(sub)?;
        self.refresh_changelog(idx);
        self.small_commit(|shard, txn| {
            let Some(st) = shard.subs[idx].as_mut() else {
                return Ok(0);
            };
            let mut next = [shard.next_quarantine_seq, shard.next_dead_seq];
            let put = records::restore(
                txn,
                st,
                copies,
                &mut next,
                records::Limits::of(&shard.ctx.config, shard.ctx.count),
                &shard.ctx.registry,
            )
            .map_err(|e| storage(&shard.ctx.path, e))?;
            [shard.next_quarantine_seq, shard.next_dead_seq] = next;
            Ok(put)
        })
    }

    fn add_dead_letter(
        &mut self,
        sub: SubscriberId,
        row: PendingRecord,
    ) -> Result<u64, LedgerError> {
        let idx = self.sub_index(sub)?;
        self.refresh_changelog(idx);
        let seq = self.small_commit(|shard, txn| {
            let Some(st) = shard.subs[idx].as_mut() else {
                return Err(LedgerError::InvalidSubscriber(
                    "subscriber state missing".into(),
                ));
            };
            st.records.dead_lettered += 1;
            shard.dead_rows.push(row);
            let seqs = shard.write_records(txn, RecordKind::DeadLetter)?;
            seqs.first()
                .copied()
                .ok_or_else(|| LedgerError::InvalidSubscriber("subscriber state missing".into()))
        })?;
        if let Some(spec) = self.ctx.registry.get(sub) {
            spec.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
        }
        Ok(seq)
    }

    fn outbox_pending(&self, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = match txn.open_table(tables::OUTBOX) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(self.err(e)),
        };
        let mut out = Vec::new();
        for row in t.iter().map_err(|e| self.err(e))?.take(limit) {
            let (k, v) = row.map_err(|e| self.err(e))?;
            out.push((k.value(), v.value().to_vec()));
        }
        Ok(out)
    }

    fn outbox_len(&self) -> Result<u64, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        match txn.open_table(tables::OUTBOX) {
            Ok(t) => t.len().map_err(|e| self.err(e)),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
            Err(e) => Err(self.err(e)),
        }
    }

    fn outbox_span(&self) -> Result<Option<(u64, u64)>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = match txn.open_table(tables::OUTBOX) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(e) => return Err(self.err(e)),
        };
        let first = t.first().map_err(|e| self.err(e))?.map(|(k, _)| k.value());
        let last = t.last().map_err(|e| self.err(e))?.map(|(k, _)| k.value());
        Ok(first.zip(last))
    }

    fn checkpoint(&mut self, key: &str) -> Result<Option<u64>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        match txn.open_table(tables::CHANGELOG_CHECKPOINTS) {
            Ok(t) => Ok(t.get(key).map_err(|e| self.err(e))?.map(|v| v.value())),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
            Err(e) => Err(self.err(e)),
        }
    }

    fn set_checkpoints(&mut self, entries: &[(String, u64)]) -> Result<(), LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        self.small_commit(|shard, txn| {
            let mut t = txn
                .open_table(tables::CHANGELOG_CHECKPOINTS)
                .map_err(|e| storage(&shard.ctx.path, e))?;
            for (key, offset) in entries {
                t.insert(key.as_str(), *offset)
                    .map_err(|e| storage(&shard.ctx.path, e))?;
            }
            Ok(())
        })
    }

    fn outbox_write(
        &mut self,
        subscriber: &str,
        messages: &[crate::effects::OutboxMessage],
    ) -> Result<(), LedgerError> {
        self.small_commit(|shard, txn| {
            let now = shard.ctx.clock.now_ms();
            crate::ledger::records::outbox::write(
                txn,
                subscriber,
                messages,
                &mut shard.next_outbox_seq,
                now,
            )
            .map_err(|e| storage(&shard.ctx.path, e))?;
            Ok(())
        })
    }

    fn outbox_ack(&mut self, seqs: Vec<u64>) -> Result<(), LedgerError> {
        self.small_commit(|shard, txn| {
            let mut t = txn
                .open_table(tables::OUTBOX)
                .map_err(|e| storage(&shard.ctx.path, e))?;
            for seq in seqs {
                t.remove(seq).map_err(|e| storage(&shard.ctx.path, e))?;
            }
            Ok(())
        })
    }

    /// Brings the copy of the shard file at `dest`, taken while this writer went on since
    /// [`Control::BackupBegin`], up to this commit boundary: copies again the ranges written
    /// meanwhile and sets the length (`backends/tracked.rs`). Every commit is durable and only this
    /// thread writes the file, so the copy is then the state after the last commit. The
    /// writer first waits at `meeting` until every shard's writer is at a boundary, so all
    /// copies are cut at one engine-wide instant; it is paused for the wait and this copy
    /// only. Without `dest` it only stops recording. The copy still carries redb's "open"
    /// mark; see [`crate::ledger::close_copied_shard`].
    fn finish_backup(
        &self,
        dest: Option<&std::path::Path>,
        meeting: &crate::ledger::backends::tracked::Rendezvous,
    ) -> Result<crate::ledger::ShardCopy, LedgerError> {
        let started = std::time::Instant::now();
        let ranges = self.ctx.writes.stop();
        // A failed shard still meets the others, so they do not wait for it in vain.
        let cut = dest.and_then(|_| meeting.meet(&self.ctx.engine_commits));
        let met = cut.is_some();
        let waited = started.elapsed();
        let engine_commits = cut.unwrap_or_else(|| self.ctx.engine_commits.load(Ordering::Relaxed));
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if dest.is_some() && !met {
            return Err(LedgerError::DataDir {
                path: dest.map(|d| d.to_path_buf()).unwrap_or_default(),
                detail: format!("the backup gave up: not every shard's writer reached a batch boundary within {:?} (a long batch or a stopped shard); try again", meeting.timeout()),
            });
        }
        let name = self
            .ctx
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some(dest) = dest else {
            return Ok(crate::ledger::ShardCopy {
                file: name,
                bytes: 0,
                recopied_bytes: 0,
                writer_paused_us: 0,
                waited_for_shards_us: 0,
                engine_commits,
            });
        };
        let target = dest.join(&name);
        let recopied = crate::ledger::backends::tracked::recopy(&self.ctx.path, &target, &ranges)
            .map_err(|e| LedgerError::DataDir {
            path: dest.to_path_buf(),
            detail: format!("backup of {} failed: {e}", self.ctx.path.display()),
        })?;
        let paused = started.elapsed();
        let bytes = std::fs::metadata(&target).map(|m| m.len()).unwrap_or(0);
        tracing::info!(shard = self.ctx.index, bytes, recopied, paused_ms = paused.as_secs_f64() * 1e3,
            waited_ms = waited.as_secs_f64() * 1e3, engine_commits,
            "shard copied for a backup at one instant of all shards; its writer paused only for the other writers and the ranges written during the copy");
        Ok(crate::ledger::ShardCopy {
            file: name,
            bytes,
            recopied_bytes: recopied,
            writer_paused_us: paused.as_micros() as u64,
            waited_for_shards_us: waited.as_micros() as u64,
            engine_commits,
        })
    }

    fn report(&self) -> Vec<SubscriberReport> {
        self.subs
            .iter()
            .flatten()
            .map(|st| {
                let (claims, active) = st.claims.count();
                let state = st.handling.state_buf.stats();
                SubscriberReport {
                    subscriber: st.name.to_string(),
                    claims,
                    active_claims: active,
                    sealed_generations: st.claims.sealed.len() as u64,
                    quarantined: st.records.quarantined,
                    quarantine_records: st.records.quarantine.stored,
                    dead_lettered: st.records.dead_lettered,
                    dead_letter_records: st.records.dead_letter.stored,
                    filter_bytes: st.filter_bytes(),
                    index_bytes: st.claims.index_bytes(),
                    state_runs: state.runs,
                    state_run_entries: state.run_entries,
                    state_buffered: state.buffered,
                    state_retired_runs: state.retired_runs,
                }
            })
            .collect()
    }
}
