//! Quarantine and dead-letter records for operators: pages of them (read off the writer
//! threads), one by id, discard, replay through the subscriber's current handler, and the
//! restore of records a changelog carried.

use super::*;

/// The two kinds of records kept aside for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RecordKind {
    /// Same id, different payload (G4).
    Quarantine,
    /// Handler gave up, or the input was unusable.
    DeadLetter,
}

impl RecordKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            RecordKind::Quarantine => "quarantine",
            RecordKind::DeadLetter => "dead_letter",
        }
    }
}

/// A quarantine or dead-letter record as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredRecord {
    pub(crate) kind: RecordKind,
    /// `{shard}-{seq}`: stable for the record's lifetime.
    pub id: String,
    pub(crate) subscriber: String,
    /// The stored JSON record (id, key_hash, reason, attempts, headers, payload, origin...).
    pub body: serde_json::Value,
}

/// Stored bytes of records one page holds at most (beyond its first record): a list of
/// large records is paged by size as well as by count.
pub(crate) const RECORD_PAGE_BYTES: usize = 1 << 20;

/// One page of records (`Ledger::record_page`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RecordPage {
    pub(crate) records: Vec<StoredRecord>,
    /// The id to pass as `after` for the next page; `None`: this was the last.
    pub(crate) next: Option<String>,
}

/// The delivery a stored record replays, and its stored idempotency key (`id` names the
/// record in errors).
fn redelivery(
    id: &str,
    body: &serde_json::Value,
    sub: &Arc<crate::ledger::Subscriber>,
) -> Result<(Delivery, IdempotencyKey), LedgerError> {
    let Some(msg_id) = body.get("id").and_then(|v| v.as_str()) else {
        return Err(LedgerError::Invalid(format!(
            "record {id} has no idempotency key (the input was unusable); discard it instead"
        )));
    };
    let key = body
        .get("key_hash")
        .and_then(|v| v.as_str())
        .and_then(|h| u128::from_str_radix(h, 16).ok())
        .unwrap_or_else(|| key_hash(msg_id.as_bytes()));
    let payload: Vec<u8> = match (body.get("payload"), body.get("payload_base64")) {
        (Some(serde_json::Value::String(text)), _) => text.as_bytes().to_vec(),
        (_, Some(serde_json::Value::String(b64))) => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| LedgerError::Invalid(format!("record {id}: bad payload: {e}")))?
        }
        _ => {
            return Err(LedgerError::Invalid(format!(
                "record {id} keeps no payload; it cannot be replayed"
            )))
        }
    };
    let delivery = Delivery {
        id: Some(msg_id.to_string()),
        key: body.get("key").and_then(|k| k.as_str()).map(String::from),
        headers: body
            .get("headers")
            .and_then(|h| serde_json::from_value(h.clone()).ok())
            .unwrap_or_default(),
        origin: body
            .get("origin")
            .and_then(|k| k.as_str())
            .map(Origin::from),
        ..Delivery::new(Target::Resolved(sub.clone()), Payload::Bytes(payload))
    };
    let given = IdempotencyKey {
        text: msg_id.to_string(),
        hash: key,
    };
    Ok((delivery, given))
}

impl Ledger {
    /// Records of one subscriber in id order (shard, then sequence), starting after
    /// `after`, at most `limit` (see `Ledger::record_page`, which may return fewer).
    pub fn records(
        &self,
        kind: RecordKind,
        subscriber: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<StoredRecord>, LedgerError> {
        let mut out = Vec::new();
        let mut after = after.map(str::to_string);
        while out.len() < limit {
            let page = self.record_page(kind, subscriber, after.as_deref(), limit - out.len())?;
            out.extend(page.records);
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        Ok(out)
    }

    /// One page of a subscriber's records in id order (shard, then sequence), starting
    /// after `after`: at most `limit` records and about [`RECORD_PAGE_BYTES`] of them
    /// (always at least one), and the id to continue after when there may be more.
    ///
    /// Read through its own read transaction per shard, on the caller's thread: a page of
    /// large records (payloads up to the line and body limits) never holds up a writer's
    /// batches.
    pub(crate) fn record_page(
        &self,
        kind: RecordKind,
        subscriber: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<RecordPage, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let (first_shard, from) = match after {
            None => (0, 0),
            Some(id) => {
                let (shard, seq) = self.record_ref(id)?;
                (shard, seq.saturating_add(1))
            }
        };
        let mut records = Vec::new();
        let mut bytes = 0usize;
        for shard in first_shard..self.shards.len() {
            let from = if shard == first_shard { from } else { 0 };
            let rows = self.read_records(shard, kind, &sub.name, from, limit - records.len())?;
            for (seq, body) in rows {
                if !records.is_empty() && bytes + body.len() > RECORD_PAGE_BYTES {
                    let next = records.last().map(|r: &StoredRecord| r.id.clone());
                    return Ok(RecordPage { records, next });
                }
                bytes += body.len();
                records.push(StoredRecord {
                    kind,
                    id: format!("{shard}-{seq}"),
                    subscriber: sub.name.to_string(),
                    body: crate::ledger::records::with_defaults(
                        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
                    ),
                });
            }
            if records.len() >= limit {
                let next = records.last().map(|r| r.id.clone());
                return Ok(RecordPage { records, next });
            }
        }
        Ok(RecordPage {
            records,
            next: None,
        })
    }

    /// Up to `limit` stored records of one shard from sequence number `from`, read through
    /// a read transaction of the caller's (never on the writer thread).
    pub(super) fn read_records(
        &self,
        shard: usize,
        kind: RecordKind,
        subscriber: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, LedgerError> {
        if let Some(reason) = self.poison.reason() {
            return Err(LedgerError::Poisoned(reason));
        }
        let Some(db) = self.shards[shard].reader.upgrade() else {
            return Err(LedgerError::Poisoned("the shard is stopped".into()));
        };
        let path = crate::ledger::shard_path(&self.data_dir, shard);
        crate::ledger::records::page(&db, kind, subscriber, from, limit)
            .map_err(|e| crate::ledger::shard::storage(&path, e))
    }

    /// One record by id, or `None`.
    pub fn record(
        &self,
        kind: RecordKind,
        subscriber: &str,
        id: &str,
    ) -> Result<Option<StoredRecord>, LedgerError> {
        let (shard, seq) = self.record_ref(id)?;
        let sub = self.registry.resolve(subscriber, true)?;
        let rows = self.read_records(shard, kind, &sub.name, seq, 1)?;
        Ok(rows
            .into_iter()
            .find(|(s, _)| *s == seq)
            .map(|(_, bytes)| StoredRecord {
                kind,
                id: id.to_string(),
                subscriber: sub.name.to_string(),
                body: crate::ledger::records::with_defaults(
                    serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
                ),
            }))
    }

    /// Deletes a record. `Ok(false)`: no such record.
    pub fn discard_record(
        &self,
        kind: RecordKind,
        subscriber: &str,
        id: &str,
    ) -> Result<bool, LedgerError> {
        let (shard, seq) = self.record_ref(id)?;
        let sub = self.registry.resolve(subscriber, true)?;
        self.ask(shard, |reply| Control::DeleteRecord {
            kind,
            sub: sub.id,
            seq,
            reply,
        })
    }

    /// Reprocesses a stored record through the subscriber's current handler, like a new
    /// delivery: the outcome arrives on `ack` under `seq` once durable. A quarantined
    /// message replaces the claim it conflicted with. The record is removed in the same
    /// transaction as the job's final outcome (processed, duplicate or dead-lettered
    /// again, which writes a new record). `Ok(false)`: no such record.
    pub fn replay(
        &self,
        kind: RecordKind,
        subscriber: &str,
        id: &str,
        seq: u64,
        ack: AckSender,
    ) -> Result<bool, LedgerError> {
        let Some(record) = self.record(kind, subscriber, id)? else {
            return Ok(false);
        };
        let (shard, record_seq) = self.record_ref(id)?;
        let sub = self.registry.resolve(subscriber, true)?;
        let (delivery, given) = redelivery(id, &record.body, &sub)?;
        // The record's stored key; the payload is fingerprinted and handed on as stored.
        // The job runs where its placement says today (its entity's state is there); the
        // record is settled in the same transaction when it lives on that shard, and
        // right after the durable outcome otherwise (a crash in between leaves the record,
        // and replaying it again answers `duplicate`).
        let Routed {
            mut job,
            shard: target,
            ..
        } = route(self, delivery, Keying::Given(&given), ack)
            .map_err(|e| LedgerError::Invalid(format!("record {id}: {e}")))?;
        job.seq = seq;
        let settle_here = target == shard;
        job.work = crate::ledger::Work::Replay {
            kind,
            settle: settle_here.then_some(record_seq),
        };
        if !settle_here {
            self.settle_after_outcome(&mut job, shard, kind, sub.id, record_seq)?;
        }
        self.submit(target, vec![job])?;
        Ok(true)
    }

    /// Keeps a dead letter for input that never became a job (no usable key, malformed).
    /// `record` should be a JSON object (reason, payload, origin...); the ledger adds
    /// `subscriber`, `failed_at_ms`, `count` and `last_seen_ms`. A repeat of the same input
    /// (same `id`, reason and payload) bumps the count of the record already kept.
    /// Returns the record id.
    pub fn add_dead_letter(
        &self,
        subscriber: &str,
        record: serde_json::Value,
    ) -> Result<String, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let row =
            crate::ledger::records::unusable_input(sub.id, &sub.name, record, self.clock.now_ms())
                .map_err(|e| LedgerError::Invalid(e.to_string()))?;
        // Records without a key live on the subscriber name's shard.
        let shard = self.route(key_hash(sub.name.as_bytes()));
        let seq = self.ask(shard, |reply| Control::AddDeadLetter {
            sub: sub.id,
            row,
            reply,
        })?;
        Ok(format!("{shard}-{seq}"))
    }

    /// Puts the quarantine and dead-letter records a changelog restore found into the
    /// ledger of `subscriber`: each on the shard its message's repeats are decided on,
    /// replacing the record kept for the same message and payload; a copy without a body
    /// (removed where it was made) removes it on every shard. The shards write at the same
    /// time, one durable transaction each. Returns how many records were put.
    pub fn records_restore(
        &self,
        subscriber: &str,
        copies: Vec<crate::ledger::changelog::RecordCopy>,
    ) -> Result<u64, LedgerError> {
        if copies.is_empty() {
            return Ok(0);
        }
        let sub = self.registry.resolve(subscriber, true)?;
        let mut per_shard: Vec<Vec<crate::ledger::changelog::RecordCopy>> =
            (0..self.shards.len()).map(|_| Vec::new()).collect();
        for copy in copies {
            if copy.body.is_some() {
                per_shard[self.route(copy.route)].push(copy);
            } else {
                for part in per_shard.iter_mut() {
                    part.push(copy.clone());
                }
            }
        }
        let mut replies = Vec::new();
        for (shard, copies) in self.shards.iter().zip(per_shard) {
            if copies.is_empty() {
                continue;
            }
            let (tx, rx) = bounded(1);
            shard
                .tx
                .send(ShardMsg::Control(Control::RecordsRestore {
                    sub: sub.id,
                    copies,
                    reply: tx,
                }))
                .map_err(|_| stopped())?;
            replies.push(rx);
        }
        let mut put = 0;
        for rx in replies {
            put += rx.recv().map_err(|_| stopped())??;
        }
        Ok(put)
    }

    pub(super) fn record_ref(&self, id: &str) -> Result<(usize, u64), LedgerError> {
        match parse_id(id) {
            Some((shard, seq)) if shard < self.shards.len() => Ok((shard, seq)),
            _ => Err(LedgerError::Invalid(format!(
                "{id:?} is not a record id (expected SHARD-SEQ, e.g. 0-17)"
            ))),
        }
    }

    /// Makes `job`'s outcome delete the record `(kind, seq)` kept on `shard` (another shard
    /// than the job's) once the outcome is durable and settles the message, before the
    /// outcome reaches the caller.
    pub(super) fn settle_after_outcome(
        &self,
        job: &mut crate::ledger::Job,
        shard: usize,
        kind: RecordKind,
        sub: crate::ledger::SubscriberId,
        seq: u64,
    ) -> Result<(), LedgerError> {
        let (tx, rx) = bounded::<Vec<crate::ledger::Done>>(1);
        let caller = std::mem::replace(&mut job.ack, tx);
        let record_shard = self.shards[shard].tx.clone();
        std::thread::Builder::new()
            .name("dedupd-replay".into())
            .spawn(move || {
                let Ok(done) = rx.recv() else { return };
                let settled = done.iter().all(|d| {
                    !matches!(
                        d.outcome,
                        crate::ledger::Outcome::Failed { .. }
                            | crate::ledger::Outcome::Quarantined { .. }
                    )
                });
                if settled {
                    let (reply, answer) = bounded(1);
                    let asked = record_shard.send(ShardMsg::Control(Control::DeleteRecord {
                        kind,
                        sub,
                        seq,
                        reply,
                    }));
                    if asked.is_ok() {
                        let _ = answer.recv();
                    }
                }
                let _ = caller.send(done);
            })
            .map_err(|e| LedgerError::Invalid(format!("cannot start a replay: {e}")))?;
        Ok(())
    }
}
