//! Operations for operators and relays: forgetting claims, stored quarantine and
//! dead-letter records (list, inspect, replay, discard), the outbox, backups and settings
//! changes at runtime. Each runs on the owning shard's writer thread between two batches,
//! so it never interleaves with a batch, and each write is durable before it returns.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::bounded;
use serde::{Deserialize, Serialize};

use super::datadir::MANIFEST;
use super::offline::close_copied_shard;
use super::outbox::OutboxRecord;
use super::shard::{Control, ShardMsg};
use super::tracked::Rendezvous;
use super::{AckSender, Ledger, LedgerError, Origin, Placement};
use crate::config::SubscriberSettings;
use crate::envelope::{key_hash, IdempotencyKey};
use crate::source::delivery::{envelope, Delivery, Keying, Payload, Routed, Target};

/// How long an online backup waits for every shard's writer to reach a batch boundary
/// (the longest batch, a slow handler's included, must fit) before it gives up.
const BACKUP_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(30);

/// One shard file copied for a backup, and how long its writer was paused for the copy.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShardCopy {
    /// The file name (`shard-NNN.redb`).
    pub file: String,
    pub bytes: u64,
    /// Bytes written to the shard while it was copied, copied again with its writer
    /// paused.
    pub recopied_bytes: u64,
    /// How long the shard's writer paused for the backup (microseconds): waiting for the
    /// other writers to reach a batch boundary, then copying its ranges again.
    pub writer_paused_us: u64,
    /// The part of `writer_paused_us` spent waiting for the other writers.
    #[serde(default)]
    pub waited_for_shards_us: u64,
    /// Durable commits of the whole engine (all shards) when this copy was cut: the same
    /// in every shard's copy of one backup, which is what makes it one instant.
    #[serde(default)]
    pub engine_commits: u64,
}

/// The two kinds of records kept aside for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordKind {
    /// Same id, different payload (G4).
    Quarantine,
    /// Handler gave up, or the input was unusable.
    DeadLetter,
}

impl RecordKind {
    pub fn name(self) -> &'static str {
        match self {
            RecordKind::Quarantine => "quarantine",
            RecordKind::DeadLetter => "dead_letter",
        }
    }
}

/// A quarantine or dead-letter record as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StoredRecord {
    pub kind: RecordKind,
    /// `{shard}-{seq}`: stable for the record's lifetime.
    pub id: String,
    pub subscriber: String,
    /// The stored JSON record (id, key_hash, reason, attempts, headers, payload, origin...).
    pub body: serde_json::Value,
}

/// Stored bytes of records one page holds at most (beyond its first record): a list of
/// large records is paged by size as well as by count.
pub const RECORD_PAGE_BYTES: usize = 1 << 20;

/// One page of records ([`Ledger::record_page`]).
#[derive(Debug, Clone, Serialize)]
pub struct RecordPage {
    pub records: Vec<StoredRecord>,
    /// The id to pass as `after` for the next page; `None`: this was the last.
    pub next: Option<String>,
}

/// A message a handler emitted, waiting to be relayed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OutboxRow {
    /// `{shard}-{seq}`: pass to [`Ledger::outbox_ack`] once the broker acknowledged it.
    pub id: String,
    pub subscriber: String,
    /// Deterministic id derived from the incoming message id (the same on every redelivery).
    pub message_id: String,
    pub topic: String,
    pub key: Option<String>,
    pub headers: Vec<(String, String)>,
    pub payload: Vec<u8>,
    pub written_at_ms: u64,
    /// The changelog partition holding the message's emitted record: the Kafka relay
    /// tombstones it there once the broker acknowledged the message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changelog_partition: Option<i32>,
}

fn parse_id(id: &str) -> Option<(usize, u64)> {
    let (shard, seq) = id.split_once('-')?;
    Some((shard.parse().ok()?, seq.parse().ok()?))
}

/// The delivery a stored record replays, and its stored idempotency key (`id` names the
/// record in errors).
fn redelivery(
    id: &str,
    body: &serde_json::Value,
    sub: &Arc<super::Subscriber>,
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

fn stopped() -> LedgerError {
    LedgerError::Poisoned("shard writer stopped".into())
}

impl Ledger {
    fn ask<T>(
        &self,
        shard: usize,
        make: impl FnOnce(crossbeam_channel::Sender<Result<T, LedgerError>>) -> Control,
    ) -> Result<T, LedgerError> {
        let (tx, rx) = bounded(1);
        self.shards[shard]
            .tx
            .send(ShardMsg::Control(make(tx)))
            .map_err(|_| stopped())?;
        rx.recv().map_err(|_| stopped())?
    }

    /// Sends one control request to every shard, then collects the answers in shard
    /// order. The shards work on it at the same time, each between two of its batches.
    pub(super) fn ask_all<T>(
        &self,
        make: impl Fn(crossbeam_channel::Sender<Result<T, LedgerError>>) -> Control,
    ) -> Result<Vec<T>, LedgerError> {
        let mut replies = Vec::with_capacity(self.shards.len());
        for shard in &self.shards {
            let (tx, rx) = bounded(1);
            shard
                .tx
                .send(ShardMsg::Control(make(tx)))
                .map_err(|_| stopped())?;
            replies.push(rx);
        }
        replies
            .into_iter()
            .map(|rx| rx.recv().map_err(|_| stopped())?)
            .collect()
    }

    fn record_ref(&self, id: &str) -> Result<(usize, u64), LedgerError> {
        match parse_id(id) {
            Some((shard, seq)) if shard < self.shards.len() => Ok((shard, seq)),
            _ => Err(LedgerError::Invalid(format!(
                "{id:?} is not a record id (expected SHARD-SEQ, e.g. 0-17)"
            ))),
        }
    }

    /// Forgets the live claim of `(subscriber, key)` so its next delivery is processed
    /// again. Writes a tombstone that shadows every older copy of the claim until that
    /// claim would have expired. `Ok(false)`: there was no live claim.
    pub fn forget(&self, subscriber: &str, key: u128) -> Result<bool, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        // Every shard that holds a live copy writes its tombstone (see `placement.rs`).
        let forgot = self.ask_all(|reply| Control::Forget {
            sub: sub.id,
            key,
            reply,
        })?;
        Ok(forgot.into_iter().any(|f| f))
    }

    /// Records of one subscriber in id order (shard, then sequence), starting after
    /// `after`, at most `limit` (see [`Ledger::record_page`], which may return fewer).
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
    pub fn record_page(
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
                    body: super::records::with_defaults(
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
    fn read_records(
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
        let path = super::shard_path(&self.data_dir, shard);
        super::records::page(&db, kind, subscriber, from, limit)
            .map_err(|e| super::shard::storage(&path, e))
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
                body: super::records::with_defaults(
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
        } = envelope(self, delivery, Keying::Given(&given), ack)
            .map_err(|e| LedgerError::Invalid(format!("record {id}: {e}")))?;
        job.seq = seq;
        job.replace = kind == RecordKind::Quarantine;
        if target == shard {
            job.settle = Some((kind, record_seq));
        } else {
            self.settle_after_outcome(&mut job, shard, kind, sub.id, record_seq)?;
        }
        self.submit(target, vec![job])?;
        Ok(true)
    }

    /// Makes `job`'s outcome delete the record `(kind, seq)` kept on `shard` (another shard
    /// than the job's) once the outcome is durable and settles the message, before the
    /// outcome reaches the caller.
    fn settle_after_outcome(
        &self,
        job: &mut super::Job,
        shard: usize,
        kind: RecordKind,
        sub: super::SubscriberId,
        seq: u64,
    ) -> Result<(), LedgerError> {
        let (tx, rx) = bounded::<Vec<super::Done>>(1);
        let caller = std::mem::replace(&mut job.ack, tx);
        let record_shard = self.shards[shard].tx.clone();
        std::thread::Builder::new()
            .name("dedupd-replay".into())
            .spawn(move || {
                let Ok(done) = rx.recv() else { return };
                let settled = done.iter().all(|d| {
                    !matches!(
                        d.outcome,
                        super::Outcome::Failed { .. } | super::Outcome::Quarantined { .. }
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
        let row = super::records::unusable_input(sub.id, &sub.name, record, self.clock.now_ms())
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

    /// Outbox rows waiting for the relay, oldest first per shard, at most `limit` in all.
    pub fn outbox_pending(&self, limit: usize) -> Result<Vec<OutboxRow>, LedgerError> {
        let mut out = Vec::new();
        let per_shard = limit.div_ceil(self.shards.len().max(1)).max(1);
        let pending = self.ask_all(|reply| Control::OutboxPending {
            limit: per_shard,
            reply,
        })?;
        for (shard, rows) in pending.into_iter().enumerate() {
            for (seq, bytes) in rows {
                let unreadable = |e: String| {
                    LedgerError::Invalid(format!("outbox row {shard}-{seq} is unreadable: {e}"))
                };
                let r = OutboxRecord::decode(&bytes).map_err(unreadable)?;
                out.push(OutboxRow {
                    id: format!("{shard}-{seq}"),
                    payload: r.payload.bytes().map_err(unreadable)?,
                    subscriber: r.subscriber,
                    message_id: r.id,
                    topic: r.topic,
                    key: r.key,
                    headers: r.headers,
                    written_at_ms: r.written_at_ms,
                    changelog_partition: r.changelog_partition,
                });
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    /// Puts messages a changelog restore found emitted and not relayed back into the
    /// outbox of `subscriber`, except those whose id is pending already (this data
    /// directory wrote them before), and wakes the relay. The shards write equal parts at
    /// the same time, one durable transaction each. Returns how many rows it wrote.
    pub fn outbox_restore(
        &self,
        subscriber: &str,
        messages: Vec<crate::effects::OutboxMessage>,
    ) -> Result<u64, LedgerError> {
        if messages.is_empty() {
            return Ok(0);
        }
        let pending: std::collections::HashSet<String> = self
            .outbox_pending(usize::MAX)?
            .into_iter()
            .filter(|r| r.subscriber == subscriber)
            .map(|r| r.message_id)
            .collect();
        let messages: Vec<_> = messages
            .into_iter()
            .filter(|m| !pending.contains(&m.id))
            .collect();
        let n = messages.len() as u64;
        if n == 0 {
            return Ok(0);
        }
        let part = messages.len().div_ceil(self.shards.len().max(1));
        let mut replies = Vec::new();
        let mut messages = messages.into_iter().peekable();
        for shard in &self.shards {
            if messages.peek().is_none() {
                break;
            }
            let (tx, rx) = bounded(1);
            shard
                .tx
                .send(ShardMsg::Control(Control::OutboxWrite {
                    subscriber: subscriber.to_string(),
                    messages: messages.by_ref().take(part).collect(),
                    reply: tx,
                }))
                .map_err(|_| stopped())?;
            replies.push(rx);
        }
        for rx in replies {
            rx.recv().map_err(|_| stopped())??;
        }
        self.wake_outbox_relay();
        Ok(n)
    }

    /// Puts the quarantine and dead-letter records a changelog restore found into the
    /// ledger of `subscriber`: each on the shard its message's repeats are decided on,
    /// replacing the record kept for the same message and payload; a copy without a body
    /// (removed where it was made) removes it on every shard. The shards write at the same
    /// time, one durable transaction each. Returns how many records were put.
    pub fn records_restore(
        &self,
        subscriber: &str,
        copies: Vec<super::changelog::RecordCopy>,
    ) -> Result<u64, LedgerError> {
        if copies.is_empty() {
            return Ok(0);
        }
        let sub = self.registry.resolve(subscriber, true)?;
        let mut per_shard: Vec<Vec<super::changelog::RecordCopy>> =
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

    /// The changelog checkpoint stored under `key` (`<changelog topic>/<partition>`): an
    /// offset before which every change of that partition is in this data directory.
    pub fn changelog_checkpoint(&self, key: &str) -> Result<Option<u64>, LedgerError> {
        self.ask(0, |reply| Control::Checkpoint {
            key: key.to_string(),
            reply,
        })
    }

    /// Stores a changelog checkpoint, durably. Call it only once every change before
    /// `offset` is durable here: a checkpoint may lag (a restore then replays more, which
    /// is harmless) but never lead.
    pub fn set_changelog_checkpoint(&self, key: &str, offset: u64) -> Result<(), LedgerError> {
        self.set_changelog_checkpoints(vec![(key.to_string(), offset)])
    }

    /// Stores several changelog checkpoints (or values kept beside them) in one
    /// transaction: all of them durable, or none.
    pub fn set_changelog_checkpoints(
        &self,
        entries: Vec<(String, u64)>,
    ) -> Result<(), LedgerError> {
        self.ask(0, |reply| Control::SetCheckpoints { entries, reply })
    }

    /// Outbox rows pending in all shards.
    pub fn outbox_len(&self) -> Result<u64, LedgerError> {
        Ok(self
            .ask_all(|reply| Control::OutboxLen { reply })?
            .into_iter()
            .sum())
    }

    /// Marks the outbox as relayed to Kafka until the guard drops, so the HTTP pull route
    /// refuses to hand the same rows to a second consumer.
    pub fn attach_outbox_relay(&self) -> OutboxRelayGuard<'_> {
        self.outbox_relay
            .store(true, std::sync::atomic::Ordering::SeqCst);
        OutboxRelayGuard(&self.outbox_relay)
    }

    /// Whether a Kafka relay consumes the outbox.
    pub fn outbox_relayed(&self) -> bool {
        self.outbox_relay.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Makes the relay read the outbox now rather than after its poll interval.
    pub fn wake_outbox_relay(&self) {
        self.outbox_wakes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many times [`Ledger::wake_outbox_relay`] was called (the relay sleeps while it
    /// does not change).
    pub fn outbox_wakes(&self) -> u64 {
        self.outbox_wakes.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until every outbox row pending now has been relayed (and deleted), waking
    /// the relay first, or until `deadline`. Returns the rows waited for and whether they
    /// were all relayed. Rows written meanwhile are not waited for.
    pub fn wait_outbox_relayed(
        &self,
        deadline: std::time::Instant,
    ) -> Result<(u64, bool), LedgerError> {
        let marks: Vec<Option<(u64, u64)>> = self.ask_all(|reply| Control::OutboxSpan { reply })?;
        if marks.iter().all(Option::is_none) {
            return Ok((0, true));
        }
        // Rows pending now; those written after the spans were read are not waited for.
        let rows = self.outbox_len()?;
        self.wake_outbox_relay();
        loop {
            let now: Vec<Option<(u64, u64)>> =
                self.ask_all(|reply| Control::OutboxSpan { reply })?;
            let relayed = now.iter().zip(&marks).all(|(now, then)| match (now, then) {
                (Some((oldest, _)), Some((_, newest))) => oldest > newest,
                _ => true,
            });
            if relayed {
                return Ok((rows, true));
            }
            if std::time::Instant::now() >= deadline {
                return Ok((rows, false));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Deletes relayed outbox rows (call only after the broker acknowledged them).
    pub fn outbox_ack(&self, ids: &[String]) -> Result<(), LedgerError> {
        let mut by_shard: Vec<Vec<u64>> = vec![Vec::new(); self.shards.len()];
        for id in ids {
            let (shard, seq) = self.record_ref(id)?;
            by_shard[shard].push(seq);
        }
        for (shard, seqs) in by_shard.into_iter().enumerate() {
            if !seqs.is_empty() {
                self.ask(shard, |reply| Control::OutboxAck { seqs, reply })?;
            }
        }
        Ok(())
    }

    /// Copies every shard file and the manifest into `dir`, which must be absent or
    /// empty; all copies are the files at one instant of the engine. The writers go on
    /// while their files are copied; each then pauses at its next batch boundary until
    /// every writer is paused, copies again the ranges written meanwhile (`tracked.rs`)
    /// and goes on. Afterwards, off the writer threads, each copy is closed the way redb
    /// closes a file ([`close_copied_shard`]) and fsync'd, so the copy opens as a data
    /// directory of its own, read-only too. The directory entries are not fsync'd here: the caller adds files and
    /// syncs them. One backup runs at a time; a second waits.
    pub fn backup(&self, dir: &Path) -> Result<Vec<ShardCopy>, LedgerError> {
        self.backup_after_copy(dir, || {})
    }

    /// [`Ledger::backup`], running `after_copy` once the files are copied and before the
    /// writers bring the copies up to date: what it commits must be in the backup. For tests.
    #[doc(hidden)]
    pub fn backup_after_copy(
        &self,
        dir: &Path,
        after_copy: impl FnOnce(),
    ) -> Result<Vec<ShardCopy>, LedgerError> {
        let bad = |detail: String| LedgerError::DataDir {
            path: dir.to_path_buf(),
            detail,
        };
        let _one_at_a_time = self.backup.lock().unwrap_or_else(|p| p.into_inner());
        if dir.exists() {
            let mut entries = std::fs::read_dir(dir).map_err(|e| bad(e.to_string()))?;
            if entries.next().is_some() {
                return Err(bad("backup directory is not empty".into()));
            }
        }
        super::create_private_dir_all(dir).map_err(|e| bad(e.to_string()))?;
        std::fs::copy(self.data_dir.join(MANIFEST), dir.join(MANIFEST))
            .map_err(|e| bad(format!("cannot copy the manifest: {e}")))?;
        let sources = match self.ask_all(|reply| Control::BackupBegin { reply }) {
            Ok(s) => s,
            Err(e) => {
                let meeting = Arc::new(Rendezvous::new(self.shards.len(), Duration::ZERO));
                let _ = self.ask_all(|reply| Control::BackupFinish {
                    dest: None,
                    meeting: meeting.clone(),
                    reply,
                });
                return Err(e);
            }
        };
        let mut copied = Ok(());
        for src in &sources {
            let name = src.file_name().unwrap_or_default();
            if let Err(e) = std::fs::copy(src, dir.join(name)) {
                copied = Err(bad(format!("backup of {} failed: {e}", src.display())));
                break;
            }
        }
        if copied.is_ok() {
            after_copy();
        }
        let dest = copied.is_ok().then(|| dir.to_path_buf());
        // Every writer pauses at its next batch boundary until all are paused, then each
        // brings its copy up to that one instant (`tracked.rs`).
        let meeting = Arc::new(Rendezvous::new(
            self.shards.len(),
            BACKUP_RENDEZVOUS_TIMEOUT,
        ));
        let finished = self.ask_all(|reply| Control::BackupFinish {
            dest: dest.clone(),
            meeting: meeting.clone(),
            reply,
        });
        copied?;
        let copies = finished?;
        for copy in &copies {
            close_copied_shard(&dir.join(&copy.file))?;
        }
        Ok(copies)
    }

    /// Replaces a subscriber's settings at runtime. Shards take the TTL and retry policy
    /// between batches (claims already written keep their expiry); sources read the key
    /// source for each new message. Validation is the caller's.
    pub fn update_settings(
        &self,
        subscriber: &str,
        settings: SubscriberSettings,
    ) -> Result<(), LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        super::check_key_source(&sub, &settings.key, self.clock.now_ms())?;
        let keyed = settings.partition_key != crate::config::PartitionSource::IdempotencyKey;
        self.prepare_placement(&sub, Placement::of(sub.handler().is_some(), keyed))?;
        *sub.settings.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(settings);
        sub.settings_epoch.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

/// Held while a Kafka relay consumes the outbox ([`Ledger::attach_outbox_relay`]).
pub struct OutboxRelayGuard<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for OutboxRelayGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}
