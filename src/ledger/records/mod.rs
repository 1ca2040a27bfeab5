//! Quarantine and dead-letter records: their stored layout, one record per
//! `(subscriber, message id, payload fingerprint)`, a retention and a cap.
//!
//! Why: a source that redelivers the same mismatched or failing message used to add a
//! full copy of its payload per redelivery (2,000 redeliveries, 2,000 records). A repeat
//! now bumps `count` and `last_seen_ms` of the record already kept, found through an
//! index `(subscriber, key hash, fingerprint) -> seq` (`quarantine_index_v1`,
//! `dead_letter_index_v1`). Records written before the index existed are not in it: the
//! first repeat of such a message stores one new record, which takes the later repeats.
//!
//! Bounds, per subscriber, kind and shard (see `docs/design.md`, "Quarantine and dead
//! letters"):
//! - **Retention** counts from when a record was first stored (`stored_at_ms`). Records
//!   are numbered in the order they are stored, so the sweep removes a prefix of each
//!   subscriber's range, at most [`SWEEP_ROWS`] per kind and maintenance step, and knows
//!   when the next record falls due without reading the table again.
//! - **Cap** (`max_records_per_subscriber`, split evenly over the shards): storing a record
//!   past it drops the oldest one. The outcome is still reported and counted; the drop is
//!   counted in `dedupd_records_dropped_total{reason="cap"}`.
//!
//! Outcome counters (`quarantined`, `dead_lettered`: how many messages had that outcome)
//! are kept apart from the records stored, in the shard's meta table under
//! `quarantined/{subscriber}` and `dead_lettered/{subscriber}`, written in the transaction
//! that stores the records. A data directory without them starts from its record count.
//! Everything here is durable with the transaction it is given; on error nothing of it is.
//!
//! `layout.rs`: the stored layout of a record; `outbox.rs`: the outbox rows a handler's
//! `emit` writes, and their relay bookkeeping.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use redb::{Database, ReadTransaction, ReadableDatabase, ReadableTable, WriteTransaction};
use serde::Deserialize;

use super::changelog::RecordCopy;
use super::format::tables::{self, index_table, record_table};
use super::shard::SubState;
use super::{RecordKind, Registry, SubscriberId};
use crate::config::LedgerConfig;

mod layout;
pub(crate) mod outbox;

pub(crate) use layout::{dead_letter, quarantine, unusable_input, with_defaults, PendingRecord};
use layout::{merge_key, text};
pub(crate) use layout::{StoredPayload, StoredRecordError};

/// Records removed per kind, subscriber and maintenance step by the retention sweep.
pub(crate) const SWEEP_ROWS: usize = 64;

/// Meta key of a subscriber's outcome counter.
fn outcome_key(kind: RecordKind, subscriber: &str) -> String {
    match kind {
        RecordKind::Quarantine => format!("quarantined/{subscriber}"),
        RecordKind::DeadLetter => format!("dead_lettered/{subscriber}"),
    }
}

/// The fields a stored record is swept and unindexed by. Loosely typed: dead letters of
/// unusable input carry whatever fields their source gave them.
#[derive(Deserialize)]
struct Stamp {
    #[serde(default)]
    stored_at_ms: Option<serde_json::Value>,
    #[serde(default)]
    failed_at_ms: Option<serde_json::Value>,
    #[serde(default)]
    received_at_ms: Option<serde_json::Value>,
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default)]
    key_hash: Option<serde_json::Value>,
    #[serde(default)]
    fingerprint: Option<serde_json::Value>,
    #[serde(default)]
    origin: Option<serde_json::Value>,
}

impl Stamp {
    fn read(body: &[u8]) -> Option<Stamp> {
        serde_json::from_slice(body).ok()
    }

    /// When the record was first stored (older layouts: when it failed or arrived).
    fn stored_at(&self) -> u64 {
        [&self.stored_at_ms, &self.failed_at_ms, &self.received_at_ms]
            .into_iter()
            .find_map(|v| v.as_ref().and_then(|v| v.as_u64()))
            .unwrap_or(0)
    }

    /// The index entry that points at this record, if it was written with one.
    fn index_key(&self) -> Option<(u128, u64)> {
        let fp = u64::from_str_radix(self.fingerprint.as_ref()?.as_str()?, 16).ok()?;
        Some((merge_key(text(&self.key_hash), text(&self.id)), fp))
    }

    /// The Kafka partition the record's message came from, if it came from Kafka.
    fn partition(&self) -> Option<i32> {
        super::Origin::from(text(&self.origin)?).kafka_partition()
    }
}

/// Queues a copy of a record stored (`body`) or removed (`None`) for the subscriber's
/// changelog (`changelog.rs`, [`RecordCopy`]), if it has one and the record's message came
/// from Kafka (its `origin` names the partition).
fn travel(
    st: &mut SubState,
    kind: RecordKind,
    stamp: Option<&Stamp>,
    route: u128,
    body: Option<&[u8]>,
) {
    let Some(copies) = st.changelog.record_copies.as_mut() else {
        return;
    };
    let Some(stamp) = stamp else { return };
    let (Some((key, fingerprint)), Some(partition)) = (stamp.index_key(), stamp.partition()) else {
        return;
    };
    copies.push(RecordCopy {
        kind,
        key,
        fingerprint,
        route,
        body: body.map(<[u8]>::to_vec),
        partition,
    });
}

/// What a shard keeps in memory about one kind of record of one subscriber.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Shelf {
    /// Records stored on this shard.
    pub(crate) stored: u64,
    /// When the oldest record falls out of the retention (0: unknown, look at the next
    /// maintenance step; `u64::MAX`: no records).
    pub(crate) sweep_due_ms: u64,
}

/// Both kinds of record of one subscriber on one shard.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SubRecords {
    pub(crate) quarantine: Shelf,
    pub(crate) dead_letter: Shelf,
    /// Outcomes counted (persisted with the records).
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
}

impl SubRecords {
    pub(crate) fn shelf(&mut self, kind: RecordKind) -> &mut Shelf {
        match kind {
            RecordKind::Quarantine => &mut self.quarantine,
            RecordKind::DeadLetter => &mut self.dead_letter,
        }
    }
}

/// What a subscriber's records and outcome counters are on disk.
pub(crate) struct Loaded {
    pub(crate) records: SubRecords,
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
}

/// Up to `limit` records of `subscriber` of one kind with sequence numbers from `from`, as
/// stored, through a read transaction of its own (any thread).
pub(crate) fn page(
    db: &Database,
    kind: RecordKind,
    subscriber: &str,
    from: u64,
    limit: usize,
) -> Result<Vec<(u64, Vec<u8>)>, redb::Error> {
    let txn = db.begin_read()?;
    let t = match txn.open_table(tables::record_table(kind)) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    for row in t
        .range((subscriber, from)..=(subscriber, u64::MAX))?
        .take(limit)
    {
        let (k, v) = row?;
        out.push((k.value().1, v.value().to_vec()));
    }
    Ok(out)
}

/// Counts a subscriber's stored records and reads its outcome counters (a data directory
/// that has none yet counts one outcome per record).
pub(crate) fn load(db: &Database, subscriber: &str) -> Result<Loaded, redb::Error> {
    load_from(&db.begin_read()?, subscriber)
}

/// [`load`] through a read transaction (also of a read-only handle: `inspect`).
pub(crate) fn load_from(txn: &ReadTransaction, subscriber: &str) -> Result<Loaded, redb::Error> {
    let mut out = Loaded {
        records: SubRecords::default(),
        quarantined: 0,
        dead_lettered: 0,
    };
    for kind in [RecordKind::Quarantine, RecordKind::DeadLetter] {
        let stored = match txn.open_table(record_table(kind)) {
            Ok(t) => t.range((subscriber, 0)..=(subscriber, u64::MAX))?.count() as u64,
            Err(redb::TableError::TableDoesNotExist(_)) => 0,
            Err(e) => return Err(e.into()),
        };
        let outcomes = match txn.open_table(tables::META) {
            Ok(t) => t
                .get(outcome_key(kind, subscriber).as_str())?
                .map(|v| v.value()),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(e.into()),
        }
        .unwrap_or(stored);
        *out.records.shelf(kind) = Shelf {
            stored,
            sweep_due_ms: 0,
        };
        match kind {
            RecordKind::Quarantine => out.quarantined = outcomes,
            RecordKind::DeadLetter => out.dead_lettered = outcomes,
        }
    }
    Ok(out)
}

/// Retention and cap as they apply on one shard.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) retention_ms: u64,
    /// Records per subscriber and kind on this shard.
    pub(crate) max_stored: u64,
}

impl Limits {
    pub(crate) fn of(cfg: &LedgerConfig, shards: usize) -> Limits {
        Limits {
            retention_ms: cfg.record_retention.as_millis() as u64,
            max_stored: (cfg.max_records_per_subscriber.get() as u64)
                .div_ceil(shards.max(1) as u64)
                .max(1),
        }
    }
}

/// Why a stored record was dropped, for `dedupd_records_dropped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DropReason {
    Retention,
    Cap,
}

fn count_drop(registry: &Registry, sub: SubscriberId, kind: RecordKind, why: DropReason, n: u64) {
    if n == 0 {
        return;
    }
    if let Some(spec) = registry.get(sub) {
        let d = match kind {
            RecordKind::Quarantine => &spec.counters.quarantine_records_dropped,
            RecordKind::DeadLetter => &spec.counters.dead_letter_records_dropped,
        };
        match why {
            DropReason::Retention => d.expired.fetch_add(n, Ordering::Relaxed),
            DropReason::Cap => d.evicted.fetch_add(n, Ordering::Relaxed),
        };
    }
}

type Records<'t> = redb::Table<'t, (&'static str, u64), &'static [u8]>;
type Index<'t> = redb::Table<'t, (&'static str, u128, u64), u64>;

/// Removes one record and the index entry that points at it. `Ok(None)`: no such
/// record; else the removed record's stamp (`None` inside when it is unreadable).
fn remove_at(
    records: &mut Records<'_>,
    index: &mut Index<'_>,
    subscriber: &str,
    seq: u64,
) -> Result<Option<Option<Stamp>>, redb::Error> {
    let stamp = match records.remove((subscriber, seq))? {
        Some(old) => Stamp::read(old.value()),
        None => return Ok(None),
    };
    if let Some((key, fp)) = stamp.as_ref().and_then(|s| s.index_key()) {
        let points_here = index
            .get((subscriber, key, fp))?
            .is_some_and(|v| v.value() == seq);
        if points_here {
            index.remove((subscriber, key, fp))?;
        }
    }
    Ok(Some(stamp))
}

/// Drops a subscriber's oldest records while more than the cap are stored on this shard;
/// returns the stamps of those it dropped.
fn evict_past_cap(
    records: &mut Records<'_>,
    index: &mut Index<'_>,
    subscriber: &str,
    shelf: &mut Shelf,
    limits: Limits,
) -> Result<Vec<Option<Stamp>>, redb::Error> {
    let mut evicted = Vec::new();
    while shelf.stored > limits.max_stored {
        let oldest = records
            .range((subscriber, 0)..=(subscriber, u64::MAX))?
            .next()
            .transpose()?
            .map(|(k, _)| k.value().1);
        let Some(oldest) = oldest else { break };
        if let Some(stamp) = remove_at(records, index, subscriber, oldest)? {
            shelf.stored -= 1;
            evicted.push(stamp);
        }
    }
    Ok(evicted)
}

/// Stores `rows` (draining them): a repeat of a kept `(subscriber, key, fingerprint)`
/// bumps that record's `count` and `last_seen_ms`, anything else becomes a new record
/// numbered from `next_seq`, dropping the subscriber's oldest record past the cap. Writes
/// the touched subscribers' outcome counters. Returns the seq each row landed on.
pub(crate) fn store(
    txn: &WriteTransaction,
    kind: RecordKind,
    rows: &mut Vec<PendingRecord>,
    next_seq: &mut u64,
    subs: &mut [Option<SubState>],
    limits: Limits,
    registry: &Registry,
) -> Result<Vec<u64>, redb::Error> {
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let mut seqs = Vec::with_capacity(rows.len());
    let mut touched: Vec<SubscriberId> = Vec::new();
    {
        let mut records = txn.open_table(record_table(kind))?;
        let mut index = txn.open_table(index_table(kind))?;
        for row in rows.drain(..) {
            let Some(st) = subs.get_mut(row.sub.0 as usize).and_then(|s| s.as_mut()) else {
                continue;
            };
            if !touched.contains(&row.sub) {
                touched.push(row.sub);
            }
            let name: Arc<str> = st.name.clone();
            let ikey = (&*name, row.key, row.fingerprint);
            let kept = index.get(ikey)?.map(|v| v.value());
            if let Some(seq) = kept {
                let bumped = records
                    .get((&*name, seq))?
                    .and_then(|old| bump(old.value(), row.at_ms));
                if let Some(body) = bumped {
                    records.insert((&*name, seq), body.as_slice())?;
                    seqs.push(seq);
                    if st.changelog.record_copies.is_some() {
                        let stamp = Stamp::read(&body);
                        travel(st, kind, stamp.as_ref(), row.route, Some(&body));
                    }
                    continue;
                }
            }
            let seq = *next_seq;
            *next_seq += 1;
            records.insert((&*name, seq), row.body.as_slice())?;
            index.insert(ikey, seq)?;
            seqs.push(seq);
            if st.changelog.record_copies.is_some() {
                let stamp = Stamp::read(&row.body);
                travel(st, kind, stamp.as_ref(), row.route, Some(&row.body));
            }
            let shelf = st.records.shelf(kind);
            shelf.stored += 1;
            if shelf.sweep_due_ms == u64::MAX {
                shelf.sweep_due_ms = row.at_ms.saturating_add(limits.retention_ms);
            }
            let evicted = evict_past_cap(&mut records, &mut index, &name, shelf, limits)?;
            count_drop(
                registry,
                row.sub,
                kind,
                DropReason::Cap,
                evicted.len() as u64,
            );
            for stamp in &evicted {
                travel(st, kind, stamp.as_ref(), 0, None);
            }
        }
    }
    let mut meta = txn.open_table(tables::META)?;
    for sub in touched {
        if let Some(st) = subs.get(sub.0 as usize).and_then(|s| s.as_ref()) {
            let outcomes = match kind {
                RecordKind::Quarantine => st.records.quarantined,
                RecordKind::DeadLetter => st.records.dead_lettered,
            };
            meta.insert(outcome_key(kind, &st.name).as_str(), outcomes)?;
        }
    }
    Ok(seqs)
}

/// Puts the records of one subscriber a changelog restore found into this shard's
/// tables: a copy with a body replaces the record kept under its (key, fingerprint) or
/// becomes a new one numbered from `next_seq` (dropping the oldest past the cap); a copy
/// without one removes the record kept under it. The copies themselves are not queued
/// for the changelog again (it holds them); cap evictions are. Returns how many records
/// were put.
pub(super) fn restore(
    txn: &WriteTransaction,
    st: &mut SubState,
    copies: Vec<RecordCopy>,
    next_seq: &mut [u64; 2],
    limits: Limits,
    registry: &Registry,
) -> Result<u64, redb::Error> {
    let name: Arc<str> = st.name.clone();
    let mut put = 0;
    for copy in copies {
        let kind = copy.kind;
        let mut records = txn.open_table(record_table(kind))?;
        let mut index = txn.open_table(index_table(kind))?;
        let ikey = (&*name, copy.key, copy.fingerprint);
        let kept = index.get(ikey)?.map(|v| v.value());
        let Some(body) = copy.body else {
            if let Some(seq) = kept {
                if remove_at(&mut records, &mut index, &name, seq)?.is_some() {
                    let shelf = st.records.shelf(kind);
                    shelf.stored = shelf.stored.saturating_sub(1);
                }
            }
            continue;
        };
        put += 1;
        if let Some(seq) = kept {
            records.insert((&*name, seq), body.as_slice())?;
            continue;
        }
        let next = &mut next_seq[kind as usize];
        let seq = *next;
        *next += 1;
        records.insert((&*name, seq), body.as_slice())?;
        index.insert(ikey, seq)?;
        let shelf = st.records.shelf(kind);
        shelf.stored += 1;
        // The retention counts from when the record was first stored, elsewhere: the
        // next maintenance step looks.
        shelf.sweep_due_ms = 0;
        let evicted = evict_past_cap(&mut records, &mut index, &name, shelf, limits)?;
        count_drop(registry, st.id, kind, DropReason::Cap, evicted.len() as u64);
        for stamp in &evicted {
            travel(st, kind, stamp.as_ref(), 0, None);
        }
    }
    Ok(put)
}

/// The stored record with one more delivery seen at `at_ms`; `None` if it is unreadable
/// (the caller then stores the delivery as a new record).
fn bump(body: &[u8], at_ms: u64) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let o = v.as_object_mut()?;
    let count = o.get("count").and_then(|c| c.as_u64()).unwrap_or(1);
    o.insert("count".into(), count.saturating_add(1).into());
    o.insert("last_seen_ms".into(), at_ms.into());
    serde_json::to_vec(&v).ok()
}

/// Removes one record (discard, or settled by a replay). The outcome stays counted.
pub(crate) fn remove(
    txn: &WriteTransaction,
    st: &mut SubState,
    kind: RecordKind,
    seq: u64,
) -> Result<bool, redb::Error> {
    let mut records = txn.open_table(record_table(kind))?;
    let mut index = txn.open_table(index_table(kind))?;
    let Some(stamp) = remove_at(&mut records, &mut index, &st.name, seq)? else {
        return Ok(false);
    };
    let shelf = st.records.shelf(kind);
    shelf.stored = shelf.stored.saturating_sub(1);
    travel(st, kind, stamp.as_ref(), 0, None);
    Ok(true)
}

/// Whether some subscriber has a record that may have fallen out of the retention.
pub(crate) fn sweep_due(subs: &[Option<SubState>], now: u64) -> bool {
    subs.iter().flatten().any(|st| {
        [st.records.quarantine, st.records.dead_letter]
            .iter()
            .any(|s| s.stored > 0 && s.sweep_due_ms <= now)
    })
}

/// Removes records that were first stored a retention or longer ago, at most
/// [`SWEEP_ROWS`] per subscriber and kind. Returns whether it removed anything.
pub(crate) fn sweep(
    txn: &WriteTransaction,
    subs: &mut [Option<SubState>],
    now: u64,
    limits: Limits,
    registry: &Registry,
) -> Result<bool, redb::Error> {
    let mut did = false;
    for st in subs.iter_mut().flatten() {
        for kind in [RecordKind::Quarantine, RecordKind::DeadLetter] {
            let shelf = *st.records.shelf(kind);
            if shelf.stored == 0 || shelf.sweep_due_ms > now {
                continue;
            }
            let mut records = txn.open_table(record_table(kind))?;
            let mut index = txn.open_table(index_table(kind))?;
            let name = st.name.clone();
            let mut expired = Vec::new();
            // Stays `now` when the budget runs out: the next step goes on.
            let mut next_due = now;
            for _ in 0..SWEEP_ROWS {
                let first = records
                    .range((&*name, 0)..=(&*name, u64::MAX))?
                    .next()
                    .transpose()?
                    .map(|(k, v)| (k.value().1, Stamp::read(v.value())));
                let Some((seq, stamp)) = first else {
                    next_due = u64::MAX;
                    break;
                };
                // An unreadable record has no age; it goes with the expired ones.
                let stored_at = stamp.as_ref().map_or(0, Stamp::stored_at);
                let due = stored_at.saturating_add(limits.retention_ms);
                if due > now {
                    next_due = due;
                    break;
                }
                if let Some(stamp) = remove_at(&mut records, &mut index, &name, seq)? {
                    expired.push(stamp);
                }
            }
            let n = expired.len() as u64;
            let shelf = st.records.shelf(kind);
            shelf.stored = shelf.stored.saturating_sub(n);
            shelf.sweep_due_ms = next_due;
            count_drop(registry, st.id, kind, DropReason::Retention, n);
            for stamp in &expired {
                travel(st, kind, stamp.as_ref(), 0, None);
            }
            did |= n > 0;
        }
    }
    Ok(did)
}

#[cfg(test)]
mod tests {
    use super::layout::{DeadLetterRecord, QuarantineRecord};
    use super::*;
    use crate::fuzzing;
    use proptest::prelude::*;

    #[test]
    fn a_repeat_bumps_count_and_last_seen() {
        let body = br#"{"id":"a","count":2,"last_seen_ms":1,"payload":"x"}"#;
        let v: serde_json::Value =
            serde_json::from_slice(&bump(body, 9).expect("bumped")).expect("json");
        assert_eq!(v["count"], 3);
        assert_eq!(v["last_seen_ms"], 9);
        assert_eq!(v["payload"], "x");
        assert!(bump(b"not json", 9).is_none());
    }

    #[test]
    fn unusable_input_is_merged_and_unindexed_by_the_same_key() {
        let row = unusable_input(
            SubscriberId(0),
            "s",
            serde_json::json!({"id": 7, "reason": "no usable key", "payload": "x", "origin": "o"}),
            5,
        )
        .expect("record");
        let stamp = Stamp::read(&row.body).expect("stamp");
        assert_eq!(stamp.index_key(), Some((row.key, row.fingerprint)));
        assert_eq!(stamp.stored_at(), 5);
        let other_origin = unusable_input(
            SubscriberId(0),
            "s",
            serde_json::json!({"id": 7, "reason": "no usable key", "payload": "x", "origin": "p"}),
            6,
        )
        .expect("record");
        assert_eq!(
            (other_origin.key, other_origin.fingerprint),
            (row.key, row.fingerprint)
        );
    }

    /// Stored record bodies as the shard writes them: quarantine and dead-letter records
    /// of any strings and payload bytes, and dead letters of unusable input of any JSON.
    fn stored_body() -> impl Strategy<Value = Vec<u8>> {
        let text = || ".{0,10}";
        let quarantine = (text(), text(), fuzzing::bytes(40), any::<u64>()).prop_map(
            |(id, key_hash, payload, at)| {
                let r = QuarantineRecord {
                    v: 1,
                    subscriber: "s".into(),
                    id,
                    key_hash,
                    stored_fingerprint: format!("{at:016x}"),
                    fingerprint: format!("{:016x}", at / 3),
                    reason: "same id, different payload".into(),
                    received_at_ms: at,
                    key: None,
                    headers: vec![("h".into(), "v".into())],
                    origin: None,
                    payload: StoredPayload::of(&payload),
                    count: at % 5,
                    stored_at_ms: at,
                    last_seen_ms: at,
                };
                serde_json::to_vec(&r).unwrap_or_default()
            },
        );
        let dead = (text(), fuzzing::bytes(40), any::<u32>()).prop_map(|(id, payload, n)| {
            let r = DeadLetterRecord {
                v: 1,
                subscriber: "s".into(),
                id,
                key_hash: format!("{:032x}", u128::from(n)),
                fingerprint: format!("{n:x}"),
                kind: "permanent".into(),
                reason: "no".into(),
                attempts: n,
                received_at_ms: n.into(),
                failed_at_ms: n.into(),
                key: Some("k".into()),
                headers: Vec::new(),
                origin: Some("o".into()),
                payload: StoredPayload::of(&payload),
                count: 1,
                stored_at_ms: n.into(),
                last_seen_ms: n.into(),
            };
            serde_json::to_vec(&r).unwrap_or_default()
        });
        let unusable = (fuzzing::json(), any::<u64>()).prop_map(|(v, now)| {
            unusable_input(SubscriberId(0), "s", v, now)
                .map(|r| r.body)
                .unwrap_or_default()
        });
        prop_oneof![quarantine, dead, unusable]
    }

    /// What the shard reads of a stored record (its stamp, a repeat's bump, the listing's
    /// defaults, the typed layouts) refuses a damaged body or reads it without a panic; a
    /// bump counts one more delivery and keeps the rest.
    #[test]
    fn fuzz_stored_record_bodies_are_read_or_refused() {
        fuzzing::run(
            "stored_record",
            3000,
            fuzzing::hostile(300, stored_body()),
            |b| {
                if let Some(stamp) = Stamp::read(&b) {
                    fuzzing::decoded();
                    stamp.stored_at();
                    stamp.index_key();
                }
                if let Some(bumped) = bump(&b, 7) {
                    let before: serde_json::Value = serde_json::from_slice(&b)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let after: serde_json::Value = serde_json::from_slice(&bumped)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let count = before["count"].as_u64().unwrap_or(1);
                    prop_assert_eq!(after["count"].as_u64(), Some(count.saturating_add(1)));
                    prop_assert_eq!(after["last_seen_ms"].as_u64(), Some(7));
                }
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&b) {
                    let shown = with_defaults(v.clone());
                    if v.is_object() {
                        prop_assert!(shown["count"].is_number() || shown["count"] == v["count"]);
                    }
                }
                if let Ok(r) = serde_json::from_slice::<QuarantineRecord>(&b) {
                    r.payload.bytes().ok();
                    let again =
                        serde_json::to_vec(&r).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(
                        serde_json::from_slice::<QuarantineRecord>(&again).ok(),
                        Some(r)
                    );
                }
                if let Ok(r) = serde_json::from_slice::<DeadLetterRecord>(&b) {
                    r.payload.bytes().ok();
                    let again =
                        serde_json::to_vec(&r).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert_eq!(
                        serde_json::from_slice::<DeadLetterRecord>(&again).ok(),
                        Some(r)
                    );
                }
                Ok(())
            },
        );
    }

    #[test]
    fn fuzz_stored_payloads_round_trip_any_bytes() {
        fuzzing::run("stored_payload", 1000, fuzzing::bytes(64), |b| {
            let p = StoredPayload::of(&b);
            prop_assert_eq!(p.bytes().ok(), Some(b.clone()));
            let json = serde_json::to_vec(&p).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let back: StoredPayload =
                serde_json::from_slice(&json).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(back.bytes().ok(), Some(b));
            Ok(())
        });
    }

    #[test]
    fn cap_is_split_over_shards_and_never_zero() {
        let cfg = LedgerConfig {
            max_records_per_subscriber: std::num::NonZeroUsize::MIN.saturating_add(9),
            ..Default::default()
        };
        assert_eq!(Limits::of(&cfg, 1).max_stored, 10);
        assert_eq!(Limits::of(&cfg, 3).max_stored, 4);
        assert_eq!(Limits::of(&cfg, 64).max_stored, 1);
    }
}
