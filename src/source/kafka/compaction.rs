//! Compaction of a changelog: snapshots of handler state, and tombstones for the records
//! of expired claims.
//!
//! Every processed message is one changelog record keyed by its claim key and processing
//! time, so no two records share a key and the broker's log cleaner, left alone, drops
//! nothing. Once a claim has expired its record restores nothing but the handler state it
//! wrote (a restore skips expired claims), so the member that owns the partition lets it
//! go: the state it wrote is published again as a **snapshot** — one record per item
//! (state key, `insert-unique` mark or version, in its entity's scope) holding the item's
//! current value, keyed by the item, so a later snapshot of the same item replaces it (a
//! deleted state key's snapshot is a tombstone) — and then the record gets a **tombstone**,
//! and the cleaner removes both (the tombstone after the topic's `delete.retention.ms`).
//! A subscriber with stateful handlers thus keeps one record per live claim plus one per
//! item of state, not one per message ever processed.
//!
//! A snapshot is read and published by the shard that owns the items
//! ([`crate::ledger::Job::snapshot`]), in the order of its batches, with the changes of the
//! batch it runs in: it is never older than a change of its items published before it,
//! and a change published after it is newer. Replaying the log in offset order therefore
//! still ends in the current value of every item, whichever records the cleaner dropped:
//! a record is tombstoned only after the snapshot of its items was acknowledged. A
//! snapshot is sent only while this member owns the partition: a revoke takes the
//! partition out of the owned set under the same lock a snapshot round holds, so the
//! round finishes before the partition is released (a member that lost its partitions
//! without a revoke is the fencing gap in `docs/kafka.md`).
//!
//! A pass over a partition reads from the **compactor group's** committed offset
//! (`<changelog topic>-compactor`; the first record when there is none) in offset order
//! and stops at the first record whose claim is not yet expired by `expiry_grace` — a
//! partition's records expire roughly in the order they were produced, since the TTL is
//! the subscriber's. Snapshot records are passed over (the cleaner replaces them); an
//! emitted message's record that the relay has not tombstoned expires with the claim of
//! the message that emitted it (`changelog/mod.rs`, "Emitted"). Once the
//! snapshots and then the tombstones are acknowledged, the offset the pass stopped at is
//! committed for the compactor group, so the next pass — on this member or on whichever
//! member owns the partition next — starts there. A pass that dies midway leaves the
//! offset where it was, and the next one sends some snapshots and tombstones again, which
//! is harmless: both are right whoever sends them and however often. Records with state
//! are kept (`kept_with_state`) only when the subscriber's state cannot be read by entity
//! as it was written (its handler was removed, or its partition key changed).

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::Message;
use rdkafka::topic_partition_list::TopicPartitionList;
use rdkafka::Offset;

use super::changelog::{
    decode, decode_emitted, is_emitted_key, is_fence_key, is_record_key, is_snapshot_key,
    split_epoch, ChangelogProducer, RecordError,
};
use super::{KafkaConfig, KafkaError};
use crate::clock::{Clock, SystemClock};
use crate::ledger::changelog::Change;
use crate::ledger::{Done, Job, Ledger, Origin, Outcome, Placement, Subscriber};

/// Tombstones sent before a pass waits for their acknowledgements and commits its offset.
const TOMBSTONE_BATCH: usize = 8192;
/// How long a pass waits for the next record of a partition before it leaves the rest to
/// the next pass.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What a compaction pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Compacted {
    /// Records read.
    pub(crate) read: u64,
    /// Records of expired claims given a tombstone.
    pub(crate) tombstones: u64,
    /// Snapshot records published for the handler state those records wrote.
    pub(crate) snapshots: u64,
    /// Expired claims kept because their record carries handler state that cannot be
    /// snapshotted (see the module's doc).
    pub(crate) kept_with_state: u64,
    /// Records of emitted messages given a tombstone with their claim's record (no relay
    /// had tombstoned them). Not counted in `tombstones`.
    pub(crate) emitted: u64,
}

impl std::ops::AddAssign for Compacted {
    fn add_assign(&mut self, o: Compacted) {
        self.read += o.read;
        self.tombstones += o.tombstones;
        self.snapshots += o.snapshots;
        self.kept_with_state += o.kept_with_state;
        self.emitted += o.emitted;
    }
}

/// What a compactor needs to publish snapshots: the ledger that owns the state and the
/// partitions this member owns.
pub(crate) struct Snapshots {
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) sub: Arc<Subscriber>,
    /// The changelog partitions of the input partitions this member owns.
    pub(crate) owned: Arc<Mutex<Vec<i32>>>,
    /// Held by a snapshot round of a partition, and by a revoke while it takes partitions
    /// out of `owned`.
    pub(crate) gate: Arc<Mutex<()>>,
    /// How long a round waits for its snapshots to be published and committed.
    pub(crate) timeout: Duration,
}

/// Expired records of one partition waiting to be settled.
#[derive(Default)]
struct Settling {
    /// Record keys to tombstone.
    keys: Vec<Vec<u8>>,
    /// Keys of expired emitted records to tombstone, less those the relay tombstoned
    /// further on in the partition.
    emitted: std::collections::HashSet<Vec<u8>>,
    /// The items their records wrote, merged per entity (values ignored).
    items: BTreeMap<Option<String>, Change>,
    /// The offset after the last record read.
    next: i64,
}

impl Settling {
    fn add_items(&mut self, change: Change) {
        match self.items.entry(change.entity.clone()) {
            Entry::Vacant(v) => {
                v.insert(change);
            }
            Entry::Occupied(mut o) => {
                let merged = o.get_mut();
                merged.state.extend(change.state);
                merged.uniques.extend(change.uniques);
                merged.versions.extend(change.versions);
            }
        }
    }
}

/// Compacts the partitions of one changelog topic.
pub(crate) struct Compactor {
    consumer: BaseConsumer,
    producer: Arc<ChangelogProducer>,
    topic: String,
    grace_ms: u64,
    snapshots: Option<Snapshots>,
}

impl Compactor {
    /// A compactor of `topic`; without `snapshots`, records with handler state are kept.
    pub(crate) fn new(
        kafka: &KafkaConfig,
        producer: Arc<ChangelogProducer>,
        topic: String,
        snapshots: Option<Snapshots>,
    ) -> Result<Compactor, KafkaError> {
        let consumer: BaseConsumer = super::client_config(kafka)
            .set("group.id", format!("{topic}-compactor"))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .create()
            .map_err(|source| KafkaError::Client {
                what: format!("compacting {topic}"),
                source,
            })?;
        Ok(Compactor {
            consumer,
            producer,
            topic,
            grace_ms: kafka.changelog.expiry_grace.as_millis() as u64,
            snapshots,
        })
    }

    /// One pass over `partitions` at wall-clock time `now_ms` (see the module's doc).
    /// Stops early, with what it committed so far, when `stop` is set.
    pub(crate) fn pass(
        &self,
        partitions: &[i32],
        now_ms: u64,
        stop: &AtomicBool,
    ) -> Result<Compacted, KafkaError> {
        let mut total = Compacted::default();
        for &p in partitions {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            total += self.partition(p, now_ms, stop)?;
        }
        Ok(total)
    }

    fn partition(&self, p: i32, now_ms: u64, stop: &AtomicBool) -> Result<Compacted, KafkaError> {
        let topic = &self.topic;
        let client = |source: rdkafka::error::KafkaError| KafkaError::Client {
            what: format!("compacting {topic}/{p}"),
            source,
        };
        let (low, high) = self
            .consumer
            .fetch_watermarks(topic, p, Duration::from_secs(10))
            .map_err(client)?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(topic, p);
        let committed = self
            .consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .map_err(client)?;
        let from = match committed.find_partition(topic, p).map(|e| e.offset()) {
            Some(Offset::Offset(o)) => o.max(low),
            _ => low,
        };
        let mut done = Compacted::default();
        if from >= high {
            return Ok(done);
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(from))
            .map_err(client)?;
        self.consumer.assign(&tpl).map_err(client)?;
        let mut batch = Settling {
            next: from,
            ..Default::default()
        };
        let mut last_record = Instant::now();
        let mut moved = false;
        while batch.next < high && !stop.load(Ordering::Relaxed) {
            let Some(m) = self.consumer.poll(Duration::from_millis(100)) else {
                if last_record.elapsed() > READ_TIMEOUT {
                    tracing::warn!(%topic, partition = p, offset = batch.next,
                        "changelog compaction read nothing for {READ_TIMEOUT:?}; the next pass goes on from here");
                    break;
                }
                continue;
            };
            last_record = Instant::now();
            let m = m.map_err(client)?;
            done.read += 1;
            match self.take(&m, &mut batch, &mut done, now_ms) {
                Ok(true) => {}
                Ok(false) => break, // live: so, roughly, is everything after it
                Err(e) => {
                    tracing::warn!(%topic, partition = p, offset = m.offset(), error = %e,
                        "changelog compaction stopped at a record it cannot read");
                    break;
                }
            }
            batch.next = m.offset() + 1;
            if batch.keys.len() + batch.emitted.len() >= TOMBSTONE_BATCH
                && !self.settle(p, &mut batch, &mut done)?
            {
                moved = true;
                break;
            }
        }
        if !moved {
            self.settle(p, &mut batch, &mut done)?;
        }
        self.consumer.unassign().map_err(client)?;
        Ok(done)
    }

    /// Takes one record into `batch`: false when it is still live (the pass stops there).
    fn take<M: Message>(
        &self,
        m: &M,
        batch: &mut Settling,
        done: &mut Compacted,
        now_ms: u64,
    ) -> Result<bool, RecordError> {
        // Snapshots are replaced by the cleaner, quarantine and dead-letter records by
        // their owner's tombstones: both are passed over. Fences too: every restore needs
        // every fence.
        let passed_over = m
            .key()
            .is_some_and(|k| is_snapshot_key(k) || is_record_key(k) || is_fence_key(k));
        let emitted = m.key().is_some_and(is_emitted_key);
        // The value under its epoch. A value a former owner published after this member's
        // fence is compacted like any other: restores skip it, and a snapshot holds this
        // member's value of an item, not the change's.
        let payload = m
            .payload()
            .map(split_epoch)
            .transpose()?
            .map(|(_, inner)| inner);
        if let (Some(value), true) = (payload, emitted) {
            // An emitted message the relay has not tombstoned (its outbox is read over
            // HTTP, or not at all): it goes with the claim of the message that emitted it.
            let expires_at_ms = decode_emitted(value)?.expires_at_ms;
            if expires_at_ms.saturating_add(self.grace_ms) > now_ms {
                return Ok(false);
            }
            if let Some(key) = m.key() {
                batch.emitted.insert(key.to_vec());
            }
        } else if emitted && m.payload().is_none() {
            // The relay's tombstone: the message was relayed, its record goes.
            if let Some(key) = m.key() {
                batch.emitted.remove(key);
            }
        } else if let (Some(value), false) = (payload, passed_over) {
            let change = decode(value)?;
            if change.expires_at_ms.saturating_add(self.grace_ms) > now_ms {
                return Ok(false);
            }
            if change.has_effects() {
                if !self.can_snapshot(&change) {
                    done.kept_with_state += 1;
                } else if let Some(key) = m.key() {
                    batch.keys.push(key.to_vec());
                    batch.add_items(change);
                }
            } else if let Some(key) = m.key() {
                batch.keys.push(key.to_vec());
            }
        }
        Ok(true)
    }

    /// Whether the state `change` wrote can be snapshotted: the subscriber places its
    /// messages as that change's message was placed (by entity when it had one, on the
    /// subscriber's shard when not), so the snapshot reads the shard that holds the state.
    fn can_snapshot(&self, change: &Change) -> bool {
        let Some(s) = &self.snapshots else {
            return false;
        };
        matches!(
            (s.sub.placement(), change.entity.is_some()),
            (Placement::Entity, true) | (Placement::Subscriber, false)
        )
    }

    /// Publishes the snapshots of a batch's items (through the shards that own them) and
    /// waits until they are committed, holding the gate. Returns the snapshot records sent,
    /// or `None` when this member no longer owns partition `p`.
    fn snapshot(
        &self,
        p: i32,
        items: BTreeMap<Option<String>, Change>,
    ) -> Result<Option<u64>, KafkaError> {
        let Some(s) = &self.snapshots else {
            return Ok(Some(0));
        };
        let _round = s.gate.lock().unwrap_or_else(|e| e.into_inner());
        if !s
            .owned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&p)
        {
            return Ok(None);
        }
        let origin = Origin::Kafka {
            topic: Arc::from(self.topic.as_str()),
            partition: p,
            offset: -1,
        };
        let (tx, rx) = crossbeam_channel::unbounded::<Vec<Done>>();
        let mut staged: Vec<Vec<Job>> = (0..s.ledger.shard_count()).map(|_| Vec::new()).collect();
        let (mut jobs, mut records) = (0u64, 0u64);
        for (entity, items) in items {
            records += (items.state.len() + items.uniques.len() + items.versions.len()) as u64;
            let mut job = Job::snapshot(jobs, s.sub.id, items, origin.clone(), tx.clone());
            let shard = s.ledger.place(&s.sub, &mut job, entity);
            staged[shard].push(job);
            jobs += 1;
        }
        for (shard, jobs) in staged.into_iter().enumerate() {
            if !jobs.is_empty() {
                s.ledger.submit(shard, jobs)?;
            }
        }
        let deadline = Instant::now() + s.timeout;
        let mut settled = 0u64;
        while settled < jobs {
            let left = deadline.saturating_duration_since(Instant::now());
            let dones = rx
                .recv_timeout(left)
                .map_err(|_| KafkaError::SnapshotsLate {
                    left: jobs - settled,
                    jobs,
                    topic: self.topic.clone(),
                    partition: p,
                    timeout: s.timeout,
                })?;
            for d in dones {
                if let Outcome::Failed { reason } = d.outcome {
                    return Err(KafkaError::SnapshotFailed {
                        topic: self.topic.clone(),
                        partition: p,
                        reason,
                    });
                }
                settled += 1;
            }
        }
        Ok(Some(records))
    }

    /// Publishes the batch's snapshots, then sends its tombstones and waits for their
    /// acknowledgements, then commits the offset after its last record as the partition's
    /// compaction offset. Returns `false`, having sent nothing, when this member no longer
    /// owns the partition.
    fn settle(
        &self,
        p: i32,
        batch: &mut Settling,
        done: &mut Compacted,
    ) -> Result<bool, KafkaError> {
        let topic = &self.topic;
        if !batch.items.is_empty() {
            match self.snapshot(p, std::mem::take(&mut batch.items))? {
                Some(n) => done.snapshots += n,
                None => return Ok(false),
            }
        }
        let (n, emitted) = (batch.keys.len() as u64, batch.emitted.len() as u64);
        if n + emitted > 0 {
            batch.keys.extend(batch.emitted.drain());
            self.producer
                .tombstone(p, &batch.keys)
                .and_then(|acks| acks.acknowledged())
                .map_err(|source| KafkaError::Changelog {
                    what: format!("tombstones to {topic}/{p}"),
                    source: Box::new(source),
                })?;
            batch.keys.clear();
            done.tombstones += n;
            done.emitted += emitted;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(batch.next))
            .map_err(|source| KafkaError::Client {
                what: format!("compacting {topic}/{p}"),
                source,
            })?;
        self.consumer
            .commit(&tpl, CommitMode::Sync)
            .map_err(|source| KafkaError::Client {
                what: format!("compaction offset of {topic}/{p}"),
                source,
            })?;
        Ok(true)
    }
}

/// The compaction thread of one subscription: a pass over the partitions this member owns
/// every `compaction_interval`.
pub(crate) struct CompactionThread {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl CompactionThread {
    /// Starts compacting. `owned` is kept current by the consumer (the changelog
    /// partitions of the input partitions it holds); `count` is given what each pass did.
    pub(crate) fn spawn(
        compactor: Compactor,
        subscriber: Arc<str>,
        interval: Duration,
        owned: Arc<Mutex<Vec<i32>>>,
        count: impl Fn(&Compacted) + Send + 'static,
    ) -> std::io::Result<CompactionThread> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name(format!("compact-{subscriber}"))
            .spawn(move || {
                let topic = compactor.topic.clone();
                while !flag.load(Ordering::Relaxed) {
                    let started = Instant::now();
                    while started.elapsed() < interval && !flag.load(Ordering::Relaxed) {
                        std::thread::sleep(interval.min(Duration::from_millis(50)));
                    }
                    let partitions = owned.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    if partitions.is_empty() || flag.load(Ordering::Relaxed) {
                        continue;
                    }
                    // The engine's time, which expired the claims (a jump of the wall
                    // clock does not move it).
                    let now_ms = SystemClock.now_ms();
                    match compactor.pass(&partitions, now_ms, &flag) {
                        Ok(c) => {
                            count(&c);
                            if c.tombstones > 0 || c.kept_with_state > 0 || c.emitted > 0 {
                                tracing::info!(%subscriber, %topic, ?partitions, read = c.read,
                                    tombstones = c.tombstones, snapshots = c.snapshots,
                                    kept_with_state = c.kept_with_state,
                                    emitted_tombstones = c.emitted,
                                    "changelog compacted: the handler state of expired claims snapshotted, their records tombstoned");
                            } else {
                                tracing::debug!(%subscriber, %topic, ?partitions, read = c.read,
                                    "changelog compaction pass: nothing expired");
                            }
                        }
                        Err(e) => tracing::warn!(%subscriber, %topic, error = %e,
                            "changelog compaction pass failed; the next one goes on from the last committed offset"),
                    }
                }
            })?;
        Ok(CompactionThread {
            stop,
            handle: Some(handle),
        })
    }
}

impl Drop for CompactionThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
