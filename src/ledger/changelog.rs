//! Changes a subscriber's batches publish before they commit, and their replay.
//!
//! A subscriber with a [`ChangelogSink`] (the Kafka source installs one per subscription
//! with `changelog = true`, see `source/kafka/changelog/`) hands every processed
//! message's claim and handler-state effects to the sink **before** the batch commits
//! locally; the sink returns only when they are durable elsewhere (acknowledged by a
//! topic). The local ledger therefore never holds a processed message its changelog lacks:
//! it is a prefix-consistent copy of the changelog, and replaying the changelog on top of
//! it (or into an empty ledger) gives exactly the claims and state the changelog describes.
//! A sink that fails stops the shard like a failed commit (G7): nothing of the batch was
//! acknowledged, and the changes it did publish are replayed by whoever restores next.
//!
//! Replay goes through [`Job::restore`]: a job that stores a claim with its original times
//! and absorbs the effects into the subscriber's state, with no handler call, on the shard
//! the message itself would be placed on.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{AckSender, ClaimRecord, Job, Origin, SubscriberId};
use crate::effects::{Effects, OutboxMessage};

/// A subscriber's changelog on one shard: where its batches' changes are published
/// before they commit, and the current batch's.
#[derive(Default)]
pub(crate) struct SubChangelog {
    pub(crate) sink: Option<Arc<dyn ChangelogSink>>,
    /// This batch's processed messages, for `sink`.
    pub(crate) changes: Vec<Change>,
    /// Quarantine and dead-letter records stored or removed by the current transaction,
    /// for `sink` (`Some` exactly while it has one; `records/`).
    pub(crate) record_copies: Option<Vec<RecordCopy>>,
}

impl SubChangelog {
    /// Sets where the subscriber's changes and record copies are published (`None`: it
    /// has no changelog).
    pub(crate) fn set(&mut self, sink: Option<Arc<dyn ChangelogSink>>) {
        match (&sink, &self.record_copies) {
            (Some(_), None) => self.record_copies = Some(Vec::new()),
            (None, Some(_)) => self.record_copies = None,
            _ => {}
        }
        self.sink = sink;
    }
}

/// One processed message as a changelog carries it: its claim and the state it wrote, as
/// the handler wrote it (unscoped; `entity` names the scope).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// 128-bit hash of the idempotency key.
    pub key: u128,
    /// The idempotency key's text (for operators reading the topic).
    pub id: String,
    pub fingerprint: u64,
    pub processed_at_ms: u64,
    pub expires_at_ms: u64,
    pub handler_version: u64,
    /// The entity the message was placed by (its state scope), if any.
    pub entity: Option<String>,
    /// Handler state written (`None`: deleted), `insert-unique` marks, versions.
    pub state: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    pub uniques: BTreeSet<Vec<u8>>,
    pub versions: BTreeMap<String, u64>,
    /// Messages the handler emitted (outbox rows). Each is published as a record of its
    /// own (its *emitted record*), which the relay tombstones once the broker acknowledged
    /// the message; a restore puts those without a tombstone back into the outbox. Not
    /// part of the change's record.
    #[serde(skip)]
    pub emitted: Vec<OutboxMessage>,
    /// Where the message came from; the sink routes the change by it. Not published.
    #[serde(skip)]
    pub origin: Option<Origin>,
    /// A snapshot ([`Job::snapshot`]): the current value of each item it names, read by
    /// the shard that owns them, published one record per item (keyed by the item, so a
    /// later snapshot of the item replaces it) instead of one record for the message.
    /// Its claim is expired (all times 0): replayed, it restores only the values. Not
    /// published.
    #[serde(skip)]
    pub snapshot: bool,
    /// A quarantine or dead-letter record stored or removed by the batch: published as a
    /// record of its own (see [`RecordCopy`]) instead of a change. Not published.
    #[serde(skip)]
    pub record: Option<RecordCopy>,
}

/// A quarantine or dead-letter record as a changelog carries it, so it follows the
/// partition of the message it keeps: one changelog record per stored record, keyed by
/// what repeats are merged by (kind, key hash, payload fingerprint), holding its current
/// body (`count` included); a record removed here (discarded, settled by a replay, swept
/// by the retention, evicted by the cap) gets a tombstone (`body: None`). A restore puts
/// every record without a tombstone into the new owner's tables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordCopy {
    pub kind: super::RecordKind,
    /// Hash of the message's key, as the record's index has it.
    pub key: u128,
    /// Fingerprint of the record's payload.
    pub fingerprint: u64,
    /// The hash the message was routed by (its key, entity or subscriber), so a restore
    /// stores the record on the shard its repeats will be decided on.
    pub(crate) route: u128,
    /// The stored record (JSON, as the record tables hold it); `None`: removed.
    pub body: Option<Vec<u8>>,
    /// The input partition the record's message came from: its changelog partition.
    #[serde(skip)]
    pub partition: i32,
}

impl RecordCopy {
    /// The change that carries this copy to the sink (routed by its partition).
    pub(crate) fn into_change(self) -> Change {
        Change {
            key: self.key,
            id: String::new(),
            fingerprint: self.fingerprint,
            processed_at_ms: 0,
            expires_at_ms: 0,
            handler_version: 0,
            entity: None,
            state: BTreeMap::new(),
            uniques: BTreeSet::new(),
            versions: BTreeMap::new(),
            emitted: Vec::new(),
            origin: Some(Origin::Kafka {
                topic: String::new().into(),
                partition: self.partition,
                offset: 0,
            }),
            snapshot: false,
            record: Some(self),
        }
    }
}

impl Change {
    pub(crate) fn new(job: &Job, claim: ClaimRecord, effects: Option<Effects>) -> Change {
        let mut effects = effects.unwrap_or_default();
        let emitted = std::mem::take(&mut effects.outbox);
        Change {
            key: job.key,
            id: job.id.to_string(),
            fingerprint: claim.fingerprint,
            processed_at_ms: claim.processed_at_ms,
            expires_at_ms: claim.expires_at_ms,
            handler_version: claim.handler_version,
            entity: job.entity.as_deref().map(str::to_string),
            state: effects.state,
            uniques: effects.uniques,
            versions: effects.versions,
            emitted,
            origin: job.origin.clone(),
            snapshot: false,
            record: None,
        }
    }

    pub(crate) fn claim(&self) -> ClaimRecord {
        ClaimRecord {
            fingerprint: self.fingerprint,
            processed_at_ms: self.processed_at_ms,
            expires_at_ms: self.expires_at_ms,
            handler_version: self.handler_version,
        }
    }

    /// The state effects, to absorb into a view scoped to `entity`.
    pub(crate) fn effects(&self) -> Effects {
        Effects {
            state: self.state.clone(),
            uniques: self.uniques.clone(),
            versions: self.versions.clone(),
            outbox: Vec::new(),
        }
    }

    pub(crate) fn has_effects(&self) -> bool {
        !(self.state.is_empty() && self.uniques.is_empty() && self.versions.is_empty())
    }

    /// One record per item of a snapshot: the item's identity (kind, entity, key) and
    /// a change that holds only that item, `None` for a state key that is now deleted.
    pub fn snapshot_items(&self) -> Vec<(SnapshotItem<'_>, Option<Change>)> {
        let one = |state, uniques, versions| Change {
            key: self.key,
            id: self.id.clone(),
            fingerprint: 0,
            processed_at_ms: 0,
            expires_at_ms: 0,
            handler_version: self.handler_version,
            entity: self.entity.clone(),
            state,
            uniques,
            versions,
            emitted: Vec::new(),
            origin: None,
            snapshot: false,
            record: None,
        };
        let entity = self.entity.as_deref();
        let mut out = Vec::new();
        for (k, v) in &self.state {
            let item = SnapshotItem::State(entity, k);
            let value = v.as_ref().map(|v| {
                one(
                    BTreeMap::from([(k.clone(), Some(v.clone()))]),
                    BTreeSet::new(),
                    BTreeMap::new(),
                )
            });
            out.push((item, value));
        }
        for m in &self.uniques {
            let value = one(
                BTreeMap::new(),
                BTreeSet::from([m.clone()]),
                BTreeMap::new(),
            );
            out.push((SnapshotItem::Mark(entity, m), Some(value)));
        }
        for (k, v) in &self.versions {
            let value = one(
                BTreeMap::new(),
                BTreeSet::new(),
                BTreeMap::from([(k.clone(), *v)]),
            );
            out.push((SnapshotItem::Version(entity, k), Some(value)));
        }
        out
    }
}

/// One item of handler state as a snapshot names it: a state key, an `insert-unique`
/// mark or a version, in the scope of an entity (unscoped keys have none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotItem<'a> {
    State(Option<&'a str>, &'a [u8]),
    Mark(Option<&'a str>, &'a [u8]),
    Version(Option<&'a str>, &'a str),
}

impl SnapshotItem<'_> {
    /// A stable identity of the item: a kind byte, the entity (length-prefixed, so no
    /// two (entity, key) pairs share an encoding) and the key.
    pub fn identity(&self) -> Vec<u8> {
        let (kind, entity, key) = match *self {
            SnapshotItem::State(e, k) => (b's', e, k),
            SnapshotItem::Mark(e, k) => (b'm', e, k),
            SnapshotItem::Version(e, k) => (b'v', e, k.as_bytes()),
        };
        let mut out = Vec::with_capacity(6 + entity.map_or(0, str::len) + key.len());
        out.push(kind);
        match entity {
            Some(e) => {
                out.push(1);
                out.extend_from_slice(&(e.len() as u32).to_be_bytes());
                out.extend_from_slice(e.as_bytes());
            }
            None => out.push(0),
        }
        out.extend_from_slice(key);
        out
    }
}

/// Why a sink did not take a batch, or did not acknowledge it: the sink's own error (the
/// Kafka changelog's is `source::kafka::ChangelogError`). The ledger stops with its text
/// (`LedgerError::Changelog`).
pub type SinkError = Box<dyn std::error::Error + Send + Sync>;

/// Where a subscriber's shards publish their changes before committing.
pub trait ChangelogSink: Send + Sync + std::fmt::Debug {
    /// Starts publishing the changes, in order per source partition. The shard writes the
    /// batch into its transaction meanwhile and commits only after [`Published::wait`]
    /// said every change is durable in the changelog; an error from either stops the
    /// shard without committing the batch.
    fn publish(&self, changes: &[Change]) -> Result<Box<dyn Published>, SinkError>;
}

/// Changes on their way into a changelog.
pub trait Published: Send {
    /// Returns once every change is durable in the changelog, or why it is not.
    fn wait(self: Box<Self>) -> Result<(), SinkError>;
}

/// Changes that were durable when `publish` returned.
pub struct AlreadyPublished;

impl Published for AlreadyPublished {
    fn wait(self: Box<Self>) -> Result<(), SinkError> {
        Ok(())
    }
}

/// A slot for a subscriber's sink, read by its shards between batches.
pub(crate) type SinkSlot = std::sync::RwLock<Option<Arc<dyn ChangelogSink>>>;

impl Job {
    /// A job that replays a change from a changelog: it stores the claim (if it has not
    /// expired) and the state it wrote, with no handler call. Route it with
    /// [`super::Ledger::place`] and the change's entity, as the message itself was.
    pub fn restore(seq: u64, subscriber: SubscriberId, change: Change, ack: AckSender) -> Job {
        let mut job = Job::new(
            seq,
            subscriber,
            change.key,
            change.fingerprint,
            &change.id,
            &[],
            ack,
        );
        job.work = super::Work::Restore(Box::new(change));
        job
    }

    /// A job that reads the current value of every item `items` names (its state keys,
    /// marks and versions; the values in it are ignored) in the scope of its entity, and
    /// publishes them to the changelog as a snapshot, in the order of the shard's batches:
    /// a snapshot is never older than a change published before it. Nothing is stored.
    /// `origin` routes the snapshot to its changelog partition. Route it with
    /// [`super::Ledger::place`] and the entity, as the messages that wrote the items were.
    pub fn snapshot(
        seq: u64,
        subscriber: SubscriberId,
        mut items: Change,
        origin: Origin,
        ack: AckSender,
    ) -> Job {
        let mut job = Job::new(seq, subscriber, items.key, 0, &items.id, &[], ack);
        items.origin = Some(origin.clone());
        job.origin = Some(origin);
        job.work = super::Work::Snapshot(Box::new(items));
        job
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use super::*;

    #[test]
    fn snapshot_items_have_distinct_identities_and_carry_one_item_with_no_claim() {
        let ids = [
            SnapshotItem::State(Some("a"), b"bc").identity(),
            SnapshotItem::State(Some("ab"), b"c").identity(),
            SnapshotItem::State(None, b"abc").identity(),
            SnapshotItem::State(Some(""), b"abc").identity(),
            SnapshotItem::Mark(Some("a"), b"bc").identity(),
            SnapshotItem::Version(Some("a"), "bc").identity(),
        ];
        let distinct: BTreeSet<&Vec<u8>> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len(), "{ids:?}");

        let mut change = Change {
            key: 7,
            id: "m-7".into(),
            fingerprint: 9,
            processed_at_ms: 100,
            expires_at_ms: 200,
            handler_version: 3,
            entity: Some("o-1".into()),
            state: BTreeMap::from([
                (b"label".to_vec(), Some(b"L".to_vec())),
                (b"gone".to_vec(), None),
            ]),
            uniques: BTreeSet::from([b"u".to_vec()]),
            versions: BTreeMap::from([("v".to_string(), 4)]),
            emitted: Vec::new(),
            origin: None,
            snapshot: true,
            record: None,
        };
        let items = change.snapshot_items();
        assert_eq!(items.len(), 4);
        let deleted: Vec<_> = items.iter().filter(|(_, v)| v.is_none()).collect();
        assert_eq!(deleted.len(), 1);
        assert_eq!(deleted[0].0, SnapshotItem::State(Some("o-1"), b"gone"));
        for (item, value) in items.iter().filter_map(|(i, v)| Some((i, v.as_ref()?))) {
            assert_eq!(value.claim().expires_at_ms, 0, "{item:?} restores no claim");
            assert_eq!(value.entity.as_deref(), Some("o-1"));
            let n = value.state.len() + value.uniques.len() + value.versions.len();
            assert_eq!(n, 1, "{item:?}: one item per record");
        }
        change.state.clear();
        change.uniques.clear();
        change.versions.clear();
        assert!(change.snapshot_items().is_empty());
    }

    #[test]
    fn a_change_keeps_the_claim_and_effects_it_was_made_from() {
        let job = Job::new(
            7,
            SubscriberId(3),
            42,
            9,
            "m-1",
            b"{}",
            crossbeam_channel::unbounded().0,
        );
        let claim = ClaimRecord {
            fingerprint: 9,
            processed_at_ms: 100,
            expires_at_ms: 200,
            handler_version: 5,
        };
        let mut effects = Effects::default();
        effects
            .state
            .insert(b"count/a".to_vec(), Some(b"1".to_vec()));
        effects.state.insert(b"gone".to_vec(), None);
        effects.uniques.insert(b"label\0a".to_vec());
        effects.versions.insert("v".into(), 4);
        let emitted = OutboxMessage {
            id: "m-1#emit#1".into(),
            topic: "out".into(),
            key: None,
            headers: Vec::new(),
            payload: b"x".to_vec(),
            changelog_partition: Some(2),
        };
        let mut with_outbox = effects.clone();
        with_outbox.outbox.push(emitted.clone());
        let change = Change::new(&job, claim, Some(with_outbox));
        assert_eq!(change.claim(), claim);
        assert_eq!((change.key, change.id.as_str()), (42, "m-1"));
        assert!(change.has_effects());
        // Emitted messages travel as records of their own, not in the change's effects.
        assert_eq!(change.effects(), effects);
        assert_eq!(change.emitted, [emitted]);
        let restore = Job::restore(
            1,
            SubscriberId(3),
            change.clone(),
            crossbeam_channel::unbounded().0,
        );
        assert_eq!((restore.key, restore.fingerprint), (42, 9));
        assert_eq!(
            restore.work,
            super::super::Work::Restore(Box::new(change.clone()))
        );
    }
}
