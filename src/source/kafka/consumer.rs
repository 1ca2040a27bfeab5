//! One consumer-group member feeding one subscriber.
//!
//! Offsets (G1): `enable.auto.offset.store=false`; an offset is stored only when every
//! earlier message of its partition has a durable outcome (and dead letters were
//! acknowledged by the dead-letter topic). Stored offsets are committed every
//! `commit_interval`, before partitions are revoked, and at shutdown. A crash loses at most
//! uncommitted offsets: those messages are delivered again and the ledger answers
//! `duplicate`.
//!
//! Rebalance: librdkafka calls the rebalance callback from inside `poll` on this thread.
//! Before revoked partitions are released, their staged jobs are submitted, their
//! outcomes awaited (up to `drain_timeout`), their offsets stored and committed; then their
//! state is dropped, so a late outcome for them is ignored and no offset is ever stored for
//! a partition this member no longer owns.

mod dead_letter;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{select, unbounded, Receiver, Sender};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::producer::ThreadedProducer;
use rdkafka::statistics::Statistics;
use rdkafka::topic_partition_list::TopicPartitionList;
use rdkafka::ClientContext;

use crate::config::SubscriberSettings;
use crate::envelope::Envelope;
use crate::ledger::{Done, Job, Ledger, Origin, Outcome, Subscriber};
use crate::source::delivery::{envelope, Delivery, Keying, Routed, Target};
use crate::telemetry::Latency;

use super::keying::{self, raw_header_key_hash, RecordView};
use super::offsets::OffsetTracker;
use super::{KafkaConfig, KafkaError, SubscriptionConfig};
use dead_letter::{DeadLetterTopic, DeliveryContext};

/// Bits of a job's `seq` that hold the message's local number in its partition; the bits
/// above name the partition's slot (one per assignment, never reused).
const LOCAL_BITS: u32 = 40;
const LOCAL_MASK: u64 = (1 << LOCAL_BITS) - 1;
/// Jobs per submission to one shard.
const CHUNK: usize = 512;
/// Messages taken from the consumer before staged jobs are submitted and acks handled.
const BURST: usize = 2048;

/// Live counters of a subscription, readable while it runs.
#[derive(Debug, Default)]
pub struct SourceStats {
    /// Messages received from Kafka.
    pub received: AtomicU64,
    /// Messages whose offsets were stored (outcome durable, dead letters delivered).
    pub released: AtomicU64,
    pub processed: AtomicU64,
    pub duplicate: AtomicU64,
    pub quarantined: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub rejected: AtomicU64,
    /// Partitions revoked from this member, and revocations whose drain timed out.
    pub revoked_partitions: AtomicU64,
    pub revoke_drain_timeouts: AtomicU64,
    /// Revocations whose commit the group coordinator refused (a rebalance in progress):
    /// the new owner starts from the last committed offset and, since instances do not
    /// share claims, processes again what this member processed after it.
    pub revoke_commit_failures: AtomicU64,
    /// Offsets stored (calls to `store_offsets`).
    pub offset_stores: AtomicU64,
    /// Partitions currently assigned to this member.
    pub assigned_partitions: AtomicU64,
    /// Rebalances after which another member of the group held partitions of a subscribed
    /// topic: instances do not share claims, so a partition that moves is processed again
    /// (docs/kafka.md, "Without a changelog: one instance per consumer group"). Not
    /// counted with a changelog.
    pub shared_group_rebalances: AtomicU64,
    /// Changes replayed from the changelog into the ledger on assignment (`changelog = true`).
    pub restored_changes: AtomicU64,
    /// Emitted messages a restore found in the changelog with no relay's tombstone and put
    /// back into this member's outbox.
    pub restored_emitted: AtomicU64,
    /// Quarantine and dead-letter records a restore found in the changelog and put into
    /// this member's ledger.
    pub restored_records: AtomicU64,
    /// Tombstones produced to the changelog for the records of expired claims.
    pub changelog_tombstones: AtomicU64,
    /// Snapshot records produced by changelog compaction.
    pub changelog_snapshots: AtomicU64,
}

/// What was kept of a message that may still go to the dead-letter topic.
#[derive(Debug)]
pub(crate) struct Retained {
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
    /// Set when the message is dead-lettered.
    reason: String,
    attempts: u32,
}

struct PartitionState {
    topic: Arc<str>,
    partition: i32,
    tracker: OffsetTracker<Retained>,
    paused: bool,
}

/// Everything the poll loop and the rebalance callback share.
struct Worker {
    ledger: Arc<Ledger>,
    sub: Arc<Subscriber>,
    ack_tx: Sender<Vec<Done>>,
    ack_rx: Receiver<Vec<Done>>,
    dlq: Option<DeadLetterTopic>,
    /// Looked up a few times per message: foldhash, not SipHash (~4 % of the consumer
    /// thread in `dedupd kafka-bench`).
    parts: HashMap<u64, PartitionState, foldhash::fast::RandomState>,
    /// (topic, partition) -> slot of the partitions owned now; a few entries, scanned
    /// without allocating for every message.
    by_tp: Vec<(Arc<str>, i32, u64)>,
    next_slot: u64,
    staged: Vec<Vec<Job>>,
    max_in_flight: usize,
    drain_timeout: Duration,
    stats: Arc<SourceStats>,
    latency: Option<Latency>,
    fatal: Option<String>,
    /// Dead letters whose produce call failed (slot, local), tried again by the poll loop.
    unsent: Vec<(u64, u64)>,
    /// Set by a rebalance callback; the poll loop then checks whether the group has other
    /// members (a metadata request, kept out of the callback).
    assignment_changed: bool,
    /// The changelog assigned partitions are restored from (`changelog = true`).
    changelog: Option<Changelog>,
}

/// What a worker needs to restore newly assigned partitions and move their checkpoints.
struct Changelog {
    kafka: KafkaConfig,
    topic: String,
    /// The publisher, for the fences of newly assigned partitions.
    sink: Arc<super::changelog::ChangelogProducer>,
    /// The highest changelog offset acknowledged per partition.
    acked: super::changelog::Acked,
    /// Checkpoints waiting for their messages: (slot, local number, changelog offset) —
    /// once every message of the slot below the local number is released, every change
    /// before the offset is committed here.
    pending: Vec<(u64, u64, i64)>,
    /// Where each partition's checkpoint is (as far as this member moved it).
    moved_to: HashMap<i32, i64>,
    last: Instant,
    /// The partitions this member owns, for the compaction thread.
    owned: Arc<Mutex<Vec<i32>>>,
    /// Held by a compaction snapshot round; a revoke takes it to remove partitions from
    /// `owned`, so no snapshot of a partition is published once it is released.
    gate: Arc<Mutex<()>>,
    /// Stopped (and joined) when the subscription stops.
    compaction: Option<super::compaction::CompactionThread>,
}

/// The consumer's context: rebalance callbacks and statistics.
struct WorkerContext {
    worker: Mutex<Worker>,
    subscriber: Arc<str>,
}

impl WorkerContext {
    fn lock(&self) -> std::sync::MutexGuard<'_, Worker> {
        self.worker.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ClientContext for WorkerContext {
    fn stats(&self, statistics: Statistics) {
        for (topic, t) in &statistics.topics {
            for (partition, p) in &t.partitions {
                if *partition < 0 || p.consumer_lag_stored < 0 {
                    continue;
                }
                metrics::gauge!(
                    crate::telemetry::metric::KAFKA_CONSUMER_LAG,
                    "subscriber" => self.subscriber.to_string(),
                    "topic" => topic.clone(),
                    "partition" => partition.to_string()
                )
                .set(p.consumer_lag_stored as f64);
            }
        }
    }
}

impl ConsumerContext for WorkerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut w = self.lock();
        match rebalance {
            Rebalance::Assign(tpl) => {
                w.assign(tpl);
                w.assignment_changed = true;
            }
            Rebalance::Revoke(tpl) => {
                w.revoke(consumer, tpl);
                w.assignment_changed = true;
            }
            Rebalance::Error(e) => {
                tracing::warn!(subscriber = %self.subscriber, "kafka rebalance error: {e}")
            }
        }
    }

    // Runs inside synchronous commits made by the rebalance callback: it must not take
    // the worker lock.
    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        match result {
            Ok(()) => {
                tracing::debug!(subscriber = %self.subscriber, "committed {} partition offsets", offsets.count())
            }
            Err(rdkafka::error::KafkaError::ConsumerCommit(
                rdkafka::types::RDKafkaErrorCode::NoOffset,
            )) => {}
            Err(e) => {
                tracing::warn!(subscriber = %self.subscriber, "offset commit failed (retried with the next commit): {e}")
            }
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Worker {
    fn slot_of(&self, topic: &str, partition: i32) -> Option<u64> {
        self.by_tp
            .iter()
            .find(|(t, p, _)| *p == partition && &**t == topic)
            .map(|(_, _, s)| *s)
    }

    fn assign(&mut self, tpl: &TopicPartitionList) {
        if !self.restore(tpl) {
            return;
        }
        for e in tpl.elements() {
            let tp: (Arc<str>, i32) = (Arc::from(e.topic()), e.partition());
            if self.slot_of(&tp.0, tp.1).is_some() {
                continue;
            }
            let slot = self.next_slot;
            self.next_slot += 1;
            tracing::info!(subscriber = %self.sub.name, topic = %tp.0, partition = tp.1, "kafka partition assigned");
            self.parts.insert(
                slot,
                PartitionState {
                    topic: tp.0.clone(),
                    partition: tp.1,
                    tracker: OffsetTracker::default(),
                    paused: false,
                },
            );
            self.by_tp.push((tp.0, tp.1, slot));
            self.stats
                .assigned_partitions
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Moves the changelog checkpoints of these partitions (all when `None`) to the
    /// changelog's end: call only after their in-flight work drained, so every change
    /// before the end is durable here. A failure is logged: the next restore reads more.
    fn checkpoint(&self, consumer: &BaseConsumer<WorkerContext>, slots: &[u64]) {
        let Some(c) = &self.changelog else {
            return;
        };
        if self.fatal.is_some() {
            return;
        }
        let partitions: Vec<i32> = slots
            .iter()
            .filter_map(|s| self.parts.get(s).map(|p| p.partition))
            .collect();
        if let Err(e) = super::changelog::checkpoint(consumer, &self.ledger, &c.topic, &partitions)
        {
            tracing::warn!(subscriber = %self.sub.name, topic = %c.topic, error = %e,
                "changelog checkpoint not moved; the next restore of these partitions reads more of the changelog");
        }
    }

    /// Moves changelog checkpoints while partitions are owned, so a restart after a crash
    /// reads only what came after the last one. Every `checkpoint_interval` it notes, per
    /// partition, the highest acknowledged changelog offset and the next message's local
    /// number (in that order: a change acknowledged before the note belongs to a message
    /// received before it); once every message below that number is released (its outcome
    /// durable), every change up to the offset is committed here and the checkpoint moves.
    fn checkpoint_owned(&mut self) {
        if self.fatal.is_some() {
            return;
        }
        let Some(c) = &mut self.changelog else {
            return;
        };
        {
            let mut owned = c.owned.lock().unwrap_or_else(|p| p.into_inner());
            if owned.len() != self.parts.len()
                || self.parts.values().any(|p| !owned.contains(&p.partition))
            {
                *owned = self.parts.values().map(|p| p.partition).collect();
                owned.sort_unstable();
            }
        }
        if c.last.elapsed() >= c.kafka.changelog.checkpoint_interval {
            c.last = Instant::now();
            let acked = c.acked.lock().unwrap_or_else(|p| p.into_inner()).clone();
            for (slot, p) in &self.parts {
                let Some(&top) = acked.get(&p.partition) else {
                    continue;
                };
                let at = c.moved_to.get(&p.partition).copied().unwrap_or(-1);
                if top + 1 > at && !c.pending.iter().any(|(s, _, o)| s == slot && *o > top) {
                    c.pending.push((*slot, p.tracker.next_local(), top + 1));
                }
            }
        }
        let parts = &self.parts;
        let (ledger, topic, sub) = (&self.ledger, &c.topic, &self.sub.name);
        let mut moved = Vec::new();
        c.pending.retain(|&(slot, mark, offset)| {
            let Some(p) = parts.get(&slot) else {
                return false; // revoked: its revoke moved the checkpoint if it drained
            };
            if p.tracker.released() < mark {
                return true;
            }
            let key = super::changelog::checkpoint_key(topic, p.partition);
            match ledger.set_changelog_checkpoint(&key, offset as u64) {
                Ok(()) => {
                    c.moved_to.insert(p.partition, offset);
                    moved.push((p.partition, offset));
                }
                Err(e) => tracing::warn!(subscriber = %sub, %topic, error = %e, "changelog checkpoint not moved"),
            }
            false
        });
        if !moved.is_empty() {
            tracing::debug!(subscriber = %sub, %topic, ?moved, "changelog checkpoints moved");
        }
    }

    /// Restores newly assigned partitions from the changelog before any of their messages
    /// is taken: a partition becomes this member's only once its claims and state are
    /// here. On failure the partitions are not taken and the subscription stops.
    fn restore(&mut self, tpl: &TopicPartitionList) -> bool {
        let Some(c) = &self.changelog else {
            return true;
        };
        let partitions: Vec<i32> = tpl
            .elements()
            .iter()
            .filter(|e| self.slot_of(e.topic(), e.partition()).is_none())
            .map(|e| e.partition())
            .collect();
        if partitions.is_empty() || self.fatal.is_some() {
            return self.fatal.is_none();
        }
        let topic = c.topic.clone();
        // Fenced first, so the restore below reads past the fence: what a former owner
        // still publishes after it is skipped by every restore, this one included.
        match c.sink.fence(&partitions) {
            Ok(epochs) => {
                tracing::debug!(subscriber = %self.sub.name, %topic, ?epochs, "changelog partitions fenced");
            }
            Err(e) => {
                tracing::error!(subscriber = %self.sub.name, %topic, ?partitions, error = %e,
                    "fencing assigned partitions in the changelog failed; the subscription stops");
                self.fatal = Some(format!("changelog fence: {e}"));
                return false;
            }
        }
        let restored =
            super::changelog::restore(&self.ledger, &self.sub, &c.kafka, &topic, &partitions);
        match restored {
            Ok(r) => {
                if let Some(c) = &mut self.changelog {
                    c.moved_to.extend(r.ends.iter().copied());
                }
                self.stats
                    .restored_changes
                    .fetch_add(r.changes, Ordering::Relaxed);
                self.stats
                    .restored_emitted
                    .fetch_add(r.emitted, Ordering::Relaxed);
                self.stats
                    .restored_records
                    .fetch_add(r.records, Ordering::Relaxed);
                metrics::counter!(crate::telemetry::metric::KAFKA_CHANGELOG_RESTORED_TOTAL,
                    "subscriber" => self.sub.name.to_string())
                .increment(r.changes);
                let rate = r.changes as f64 / r.elapsed.as_secs_f64().max(1e-6);
                tracing::info!(subscriber = %self.sub.name, %topic, ?partitions,
                    changes = r.changes, covered_by_checkpoint = r.skipped, fenced = r.fenced,
                    emitted_not_relayed = r.emitted, records = r.records,
                    elapsed_ms = r.elapsed.as_millis() as u64,
                    changes_per_sec = rate as u64, "partitions restored from the changelog");
                true
            }
            Err(e) => {
                tracing::error!(subscriber = %self.sub.name, %topic, ?partitions, error = %e,
                    "restoring assigned partitions from the changelog failed; the subscription stops");
                self.fatal = Some(format!("changelog restore: {e}"));
                false
            }
        }
    }

    fn revoke(&mut self, consumer: &BaseConsumer<WorkerContext>, tpl: &TopicPartitionList) {
        let slots: Vec<u64> = tpl
            .elements()
            .iter()
            .filter_map(|e| self.slot_of(e.topic(), e.partition()))
            .collect();
        if let Some(c) = &self.changelog {
            // Waits for a snapshot round in progress: its snapshots are published before
            // the partitions move, and no round starts for them afterwards.
            let _round = c.gate.lock().unwrap_or_else(|e| e.into_inner());
            let revoked: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
            c.owned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|p| !revoked.contains(p));
        }
        let lost = consumer.assignment_lost();
        if !lost {
            let deadline = Instant::now() + self.drain_timeout;
            if !self.drain(consumer, Some(&slots), deadline) {
                self.stats
                    .revoke_drain_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                tracing::error!(subscriber = %self.sub.name, "in-flight work of revoked partitions did not finish within kafka.drain_timeout; their unfinished messages will be delivered again to the new owner");
            } else {
                self.checkpoint(consumer, &slots);
                self.relay_outbox_before_release();
            }
            if self.fatal.is_none() && !commit(consumer, &self.sub.name, "commit before revoke") {
                self.stats
                    .revoke_commit_failures
                    .fetch_add(1, Ordering::Relaxed);
                if self.changelog.is_some() {
                    tracing::warn!(subscriber = %self.sub.name, "the offsets of revoked partitions were not committed before they moved: their new owner restores this member's claims from the changelog and answers duplicate for what it processed since its last commit");
                } else {
                    tracing::error!(subscriber = %self.sub.name, "the offsets of revoked partitions were not committed before they moved: their new owner processes again what this member processed since its last commit (instances do not share claims; docs/kafka.md, \"Without a changelog: one instance per consumer group\")");
                }
            }
        } else {
            tracing::warn!(subscriber = %self.sub.name, "kafka assignment lost; in-flight offsets are not stored");
            self.forget_checkpoints(tpl);
        }
        for slot in slots {
            if let Some(p) = self.parts.remove(&slot) {
                tracing::info!(subscriber = %self.sub.name, topic = %p.topic, partition = p.partition, in_flight = p.tracker.in_flight(), "kafka partition revoked");
                self.by_tp.retain(|(_, _, s)| *s != slot);
                self.stats
                    .revoked_partitions
                    .fetch_add(1, Ordering::Relaxed);
                self.stats
                    .assigned_partitions
                    .fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// A member that lost partitions (its session expired: another member may own them
    /// and have fenced them already) may have moved their checkpoints past changes it
    /// does not hold — the new owner's, published after its fence. The next restore of
    /// these partitions here replays them whole instead of trusting such a checkpoint.
    fn forget_checkpoints(&mut self, tpl: &TopicPartitionList) {
        let Some(c) = &mut self.changelog else {
            return;
        };
        for e in tpl.elements() {
            let p = e.partition();
            let key = super::changelog::checkpoint_key(&c.topic, p);
            match self.ledger.set_changelog_checkpoint(&key, 0) {
                Ok(()) => {
                    c.moved_to.remove(&p);
                }
                Err(err) => {
                    // The next restore here may then skip changes of the new owner.
                    tracing::warn!(subscriber = %self.sub.name, topic = %c.topic, partition = p, error = %err,
                        "the changelog checkpoint of a lost partition was not reset");
                }
            }
        }
    }

    /// With a changelog, the new owner of a revoked partition restores its claims and
    /// never runs its handler again, so what the handler emitted here must leave from
    /// here: the rows pending now (those of the drained partitions among them) are relayed
    /// before the partitions are released (up to `drain_timeout`). A row not relayed in
    /// time stays in this member's outbox and is relayed by it later.
    fn relay_outbox_before_release(&self) {
        if self.changelog.is_none() || !self.ledger.outbox_relayed() {
            return;
        }
        let started = Instant::now();
        match self
            .ledger
            .wait_outbox_relayed(started + self.drain_timeout)
        {
            Ok((0, _)) => {}
            Ok((rows, true)) => {
                tracing::info!(subscriber = %self.sub.name, rows, ms = started.elapsed().as_millis() as u64,
                    "outbox rows relayed before the revoked partitions were released");
            }
            Ok((rows, false)) => {
                tracing::warn!(subscriber = %self.sub.name, rows, "outbox rows were not all relayed within kafka.drain_timeout before the revoked partitions were released; they stay in this member's outbox and are relayed by it later");
            }
            Err(e) => {
                tracing::warn!(subscriber = %self.sub.name, error = %e, "could not wait for the outbox relay before releasing revoked partitions");
            }
        }
    }

    /// Submits staged jobs, then handles outcomes until the given partitions (all when
    /// `None`) have nothing in flight, or the deadline passes. Returns whether they drained.
    fn drain(
        &mut self,
        consumer: &BaseConsumer<WorkerContext>,
        slots: Option<&[u64]>,
        deadline: Instant,
    ) -> bool {
        self.flush();
        loop {
            let busy = |w: &Worker| match slots {
                Some(s) => s
                    .iter()
                    .any(|slot| w.parts.get(slot).is_some_and(|p| p.tracker.in_flight() > 0)),
                None => w.parts.values().any(|p| p.tracker.in_flight() > 0),
            };
            if !busy(self) {
                return true;
            }
            if self.fatal.is_some() || Instant::now() >= deadline {
                return false;
            }
            self.wait_and_handle(consumer, Duration::from_millis(20));
        }
    }

    /// Waits up to `timeout` for an outcome or a delivery report and handles all ready.
    fn wait_and_handle(&mut self, consumer: &BaseConsumer<WorkerContext>, timeout: Duration) {
        let never = crossbeam_channel::never();
        let reports = self
            .dlq
            .as_ref()
            .map(|d| d.reports.clone())
            .unwrap_or(never);
        select! {
            recv(self.ack_rx) -> d => if let Ok(d) = d { self.on_done(consumer, d) },
            recv(reports) -> r => if let Ok(r) = r { self.on_delivery(consumer, r) },
            default(timeout) => {},
        }
        self.handle_ready(consumer);
    }

    /// Handles every outcome and delivery report already waiting.
    fn handle_ready(&mut self, consumer: &BaseConsumer<WorkerContext>) {
        while let Ok(d) = self.ack_rx.try_recv() {
            self.on_done(consumer, d);
        }
        while let Some(r) = self.dlq.as_ref().and_then(|d| d.reports.try_recv().ok()) {
            self.on_delivery(consumer, r);
        }
    }

    fn flush(&mut self) {
        if self.fatal.is_some() {
            return;
        }
        for shard in 0..self.staged.len() {
            if !self.staged[shard].is_empty() {
                let jobs = std::mem::replace(&mut self.staged[shard], Vec::with_capacity(CHUNK));
                if let Err(e) = self.ledger.submit(shard, jobs) {
                    self.fatal = Some(e.to_string());
                    return;
                }
            }
        }
    }

    /// Routes one record to its shard. `received_at_ms` is read once per poll burst: the
    /// clock is not read per record.
    fn accept(
        &mut self,
        consumer: &BaseConsumer<WorkerContext>,
        m: &BorrowedMessage<'_>,
        received_at_ms: u64,
    ) {
        let Some(slot) = self.slot_of(m.topic(), m.partition()) else {
            // Not (or no longer) ours: the owner gets it; nothing is stored for it.
            return;
        };
        self.stats.received.fetch_add(1, Ordering::Relaxed);
        let payload = m.payload().unwrap_or_default();
        // Borrowed from the record: the delivery below is the one copy of the headers.
        let headers: Vec<(&str, &[u8])> = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key, h.value.unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let view = RecordView {
            key: m.key(),
            payload,
            headers: &headers,
        };
        let origin = || format!("kafka:{}/{}/{}", m.topic(), m.partition(), m.offset());
        // Formatted only if a record is written (`Origin`); the topic's name is shared.
        let kafka_origin = self.parts.get(&slot).map(|p| Origin::Kafka {
            topic: p.topic.clone(),
            partition: m.partition(),
            offset: m.offset(),
        });
        let delivery = Delivery {
            origin: kafka_origin,
            received_at_ms,
            ..keying::delivery(&view, Target::Resolved(self.sub.clone()))
        };
        let raw_hash = |env: &Envelope, s: &SubscriberSettings| raw_header_key_hash(&view, env, s);
        let routed = envelope(
            &self.ledger,
            delivery,
            Keying::DeriveThen(&raw_hash),
            self.ack_tx.clone(),
        );
        let retain = self.dlq.is_some() || routed.is_err();
        let retained = retain.then(|| Retained {
            key: m.key().map(<[u8]>::to_vec),
            payload: payload.to_vec(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_vec()))
                .collect(),
            reason: String::new(),
            attempts: 0,
        });
        let Some(p) = self.parts.get_mut(&slot) else {
            return;
        };
        let ts = m.timestamp().to_millis().unwrap_or(0);
        let local = p.tracker.push(m.offset(), ts, retained);
        let seq = (slot << LOCAL_BITS) | (local & LOCAL_MASK);
        match routed {
            Ok(Routed { mut job, shard, .. }) => {
                job.seq = seq;
                self.staged[shard].push(job);
                if self.staged[shard].len() >= CHUNK {
                    // A chunk leaves with its buffer; the next one gets a full-size buffer
                    // at once instead of growing (and moving its jobs) from empty.
                    let jobs =
                        std::mem::replace(&mut self.staged[shard], Vec::with_capacity(CHUNK));
                    if let Err(e) = self.ledger.submit(shard, jobs) {
                        self.fatal = Some(e.to_string());
                    }
                }
            }
            Err(e) => self.reject(consumer, slot, local, &origin(), e.to_string()),
        }
        let max = self.max_in_flight;
        if let Some(p) = self.parts.get_mut(&slot) {
            if !p.paused && p.tracker.in_flight() >= max {
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition(&p.topic, p.partition);
                match consumer.pause(&tpl) {
                    Ok(()) => p.paused = true,
                    Err(e) => tracing::warn!("pausing partition failed: {e}"),
                }
            }
        }
    }

    fn on_done(&mut self, consumer: &BaseConsumer<WorkerContext>, dones: Vec<Done>) {
        let mut counts = [0u64; 5];
        let mut touched: Vec<u64> = Vec::new();
        for d in dones {
            let (slot, local) = (d.seq >> LOCAL_BITS, d.seq & LOCAL_MASK);
            if !self.parts.contains_key(&slot) {
                continue; // revoked: its offset is not ours to store
            }
            match d.outcome {
                Outcome::Processed => counts[0] += 1,
                Outcome::Duplicate => counts[1] += 1,
                // Kept in the ledger (admin lists and replays it), not sent to the topic.
                Outcome::Quarantined { .. } => counts[2] += 1,
                Outcome::DeadLettered { reason, attempts } => {
                    counts[3] += 1;
                    self.set_aside(consumer, slot, local, reason, attempts, &mut touched);
                    continue;
                }
                Outcome::Rejected { reason } => {
                    counts[3] += 1;
                    self.set_aside(consumer, slot, local, reason, 0, &mut touched);
                    continue;
                }
                Outcome::Failed { reason } => {
                    self.fatal = Some(reason);
                    counts[4] += 1;
                    continue;
                }
            }
            if let Some(p) = self.parts.get_mut(&slot) {
                p.tracker.resolve(local);
            }
            if touched.last() != Some(&slot) {
                touched.push(slot);
            }
        }
        let s = &self.stats;
        for (i, (counter, name)) in [
            (&s.processed, "processed"),
            (&s.duplicate, "duplicate"),
            (&s.quarantined, "quarantined"),
            (&s.dead_lettered, "dead_lettered"),
        ]
        .into_iter()
        .enumerate()
        {
            if counts[i] > 0 {
                counter.fetch_add(counts[i], Ordering::Relaxed);
                metrics::counter!(crate::telemetry::metric::KAFKA_MESSAGES_TOTAL,
                    "subscriber" => self.sub.name.to_string(), "outcome" => name)
                .increment(counts[i]);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for slot in touched {
            self.advance(consumer, slot);
        }
    }

    /// Stores the partition's new watermark and resumes it when it has room again.
    fn advance(&mut self, consumer: &BaseConsumer<WorkerContext>, slot: u64) {
        if self.fatal.is_some() {
            return; // G7: nothing more is acknowledged after a storage failure
        }
        let Some(p) = self.parts.get_mut(&slot) else {
            return;
        };
        let released = p.tracker.advance(self.latency.is_some());
        if let Some(next) = released.store {
            // `store_offsets` stores exactly `next`; the per-message `store_offset` would
            // store its argument + 1.
            let mut tpl = TopicPartitionList::with_capacity(1);
            let stored = tpl
                .add_partition_offset(&p.topic, p.partition, rdkafka::Offset::Offset(next))
                .and_then(|()| consumer.store_offsets(&tpl));
            if let Err(e) = stored {
                tracing::warn!(subscriber = %self.sub.name, topic = %p.topic, partition = p.partition, "storing offset failed: {e}");
            } else {
                self.stats.offset_stores.fetch_add(1, Ordering::Relaxed);
            }
        }
        if let Some(lat) = &mut self.latency {
            let now = now_ms() as i64;
            for ts in &released.timestamps_ms {
                lat.record_us(((now - ts).max(0) as u64) * 1000);
            }
        }
        if released.count > 0 {
            self.stats
                .released
                .fetch_add(released.count, Ordering::Relaxed);
        }
        if p.paused && p.tracker.in_flight() <= self.max_in_flight / 2 {
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&p.topic, p.partition);
            match consumer.resume(&tpl) {
                Ok(()) => p.paused = false,
                Err(e) => tracing::warn!("resuming partition failed: {e}"),
            }
        }
    }
}

impl Worker {
    fn any_in_flight(&self) -> bool {
        !self.unsent.is_empty() || self.parts.values().any(|p| p.tracker.in_flight() > 0)
    }
}

/// Settings of one running subscription that a config file does not carry.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Record the latency from each message's produce timestamp to its offset being
    /// stored (the benchmark's end-to-end figure).
    pub record_latency: bool,
}

/// Consumes one subscription until `stop` is set, then drains in-flight work, stores and
/// commits offsets. Returns the latency histogram when asked to record one.
///
/// An error leaves the ledger's durable state as it was; offsets stored before it are
/// committed (they only cover durable outcomes), nothing after.
pub fn run_subscription(
    ledger: Arc<Ledger>,
    kafka: &KafkaConfig,
    subscription: &SubscriptionConfig,
    stop: &AtomicBool,
    stats: Arc<SourceStats>,
    options: &RunOptions,
) -> Result<Option<Latency>, KafkaError> {
    let consumer = start_consumer(ledger, kafka, subscription, stats.clone(), options)?;
    let name = consumer.context().subscriber.clone();
    let mut last_log = Instant::now();
    let mut last_released = 0;
    while !stop.load(Ordering::Relaxed) {
        if let Some(f) = consumer.context().lock().fatal.clone() {
            return Err(KafkaError::Ledger(f));
        }
        poll_round(&consumer, &name);
        consumer.context().lock().checkpoint_owned();
        if std::mem::take(&mut consumer.context().lock().assignment_changed)
            && !subscription.changelog
        {
            warn_if_group_is_shared(&consumer, subscription, kafka, &stats);
        }
        let released = stats.released.load(Ordering::Relaxed);
        if last_log.elapsed() >= Duration::from_secs(1) && released != last_released {
            last_log = Instant::now();
            last_released = released;
            tracing::info!(
                subscriber = %name,
                received = stats.received.load(Ordering::Relaxed),
                released,
                processed = stats.processed.load(Ordering::Relaxed),
                duplicate = stats.duplicate.load(Ordering::Relaxed),
                "kafka progress"
            );
        }
    }
    // No tombstones while the partitions drain and after (joined outside the lock).
    let compaction = consumer
        .context()
        .lock()
        .changelog
        .as_mut()
        .and_then(|c| c.compaction.take());
    drop(compaction);
    let latency = drain_and_commit(&consumer, kafka)?;
    tracing::info!(
        subscriber = %name,
        received = stats.received.load(Ordering::Relaxed),
        released = stats.released.load(Ordering::Relaxed),
        "kafka consumer stopped; offsets committed"
    );
    drop(consumer);
    Ok(latency)
}

/// After a rebalance: if this member holds only some partitions of a subscribed topic,
/// another member of the group holds the rest. Instances do not share claims, so each
/// partition move makes redeliveries run again: say so loudly (once per rebalance) and
/// count it. A topic whose metadata cannot be read is skipped.
fn warn_if_group_is_shared(
    consumer: &BaseConsumer<WorkerContext>,
    subscription: &SubscriptionConfig,
    kafka: &KafkaConfig,
    stats: &SourceStats,
) {
    let Ok(assignment) = consumer.assignment() else {
        return;
    };
    let name = &consumer.context().subscriber;
    for topic in &subscription.topics {
        let held = assignment
            .elements()
            .iter()
            .filter(|e| e.topic() == topic)
            .count();
        let total = match consumer.fetch_metadata(Some(topic), Duration::from_secs(5)) {
            Ok(m) => m
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .map_or(0, |t| t.partitions().len()),
            Err(e) => {
                tracing::debug!(subscriber = %name, %topic, "no metadata to check the group's members: {e}");
                continue;
            }
        };
        if held < total {
            stats
                .shared_group_rebalances
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                subscriber = %name,
                group = kafka.group_of(subscription),
                %topic,
                held,
                partitions = total,
                "other members of the consumer group hold partitions of this topic: dedupd instances do not share claims, so messages redelivered after a partition moves are processed again; run one instance per group (docs/kafka.md)"
            );
            return;
        }
    }
}

/// Creates the consumer-group member of one subscription, its worker and its dead-letter
/// producer, and subscribes to the topics.
fn start_consumer(
    ledger: Arc<Ledger>,
    kafka: &KafkaConfig,
    subscription: &SubscriptionConfig,
    stats: Arc<SourceStats>,
    options: &RunOptions,
) -> Result<BaseConsumer<WorkerContext>, KafkaError> {
    let sub = ledger
        .subscriber(&subscription.subscriber)
        .map_err(|e| KafkaError::Ledger(e.to_string()))?;
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    let dlq = match &kafka.dead_letter_topic {
        Some(topic) => {
            let (tx, reports) = unbounded();
            let producer: ThreadedProducer<DeliveryContext> = super::producer_config(kafka)
                .create_with_context(DeliveryContext { tx })
                .map_err(|e| KafkaError::Client(e.to_string()))?;
            Some(DeadLetterTopic {
                topic: topic.clone(),
                producer,
                reports,
            })
        }
        None => None,
    };
    let worker = Worker {
        ledger: ledger.clone(),
        sub: sub.clone(),
        ack_tx,
        ack_rx,
        dlq,
        parts: HashMap::default(),
        by_tp: Vec::new(),
        next_slot: 0,
        staged: (0..ledger.shard_count()).map(|_| Vec::new()).collect(),
        max_in_flight: kafka.max_in_flight_per_partition.get(),
        drain_timeout: kafka.drain_timeout,
        stats: stats.clone(),
        latency: options.record_latency.then(Latency::default),
        fatal: None,
        unsent: Vec::new(),
        assignment_changed: false,
        changelog: None,
    };
    let ctx = WorkerContext {
        worker: Mutex::new(worker),
        subscriber: sub.name.clone(),
    };
    let consumer: BaseConsumer<WorkerContext> = consumer_config(kafka, subscription)
        .create_with_context(ctx)
        .map_err(|e| KafkaError::Client(e.to_string()))?;
    if subscription.changelog {
        let changelog = start_changelog(&consumer, &ledger, kafka, subscription, stats)?;
        consumer.context().lock().changelog = Some(changelog);
    }
    let topics: Vec<&str> = subscription.topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topics)
        .map_err(|e| KafkaError::Client(e.to_string()))?;
    tracing::info!(subscriber = %sub.name, group = kafka.group_of(subscription), ?topics, "kafka consumer started");
    Ok(consumer)
}

/// Creates the changelog topic if needed and installs its producer as the subscriber's
/// changelog sink: from here on every batch of the subscriber publishes before it commits.
fn start_changelog(
    consumer: &BaseConsumer<WorkerContext>,
    ledger: &Arc<Ledger>,
    kafka: &KafkaConfig,
    subscription: &SubscriptionConfig,
    stats: Arc<SourceStats>,
) -> Result<Changelog, KafkaError> {
    let input = subscription.topics.first().ok_or_else(|| {
        KafkaError::Config("a subscription with a changelog needs one topic".into())
    })?;
    let partitions = super::changelog::partition_count(consumer, input)?.ok_or_else(|| {
        KafkaError::Config(format!(
            "topic {input} does not exist (yet): a changelog is created with the input topic's partition count, so create {input} first"
        ))
    })?;
    let topic = super::changelog::topic_name(&kafka.changelog.prefix, &subscription.subscriber);
    let existing = match super::changelog::partition_count(consumer, &topic)? {
        Some(n) => Some(n),
        None => {
            super::changelog::create_topic(kafka, &topic, partitions)?;
            super::changelog::partition_count(consumer, &topic)?
        }
    };
    if let Some(n) = existing {
        if n < partitions {
            return Err(KafkaError::Config(format!(
                "changelog topic {topic} has {n} partitions but {input} has {partitions}: partition p of the changelog holds the changes of partition p of the input, so it needs at least as many"
            )));
        }
    }
    let sink = Arc::new(super::changelog::ChangelogProducer::new(
        kafka,
        topic.clone(),
    )?);
    let acked = sink.acked();
    ledger
        .set_changelog(&subscription.subscriber, Some(sink.clone()))
        .map_err(|e| KafkaError::Ledger(e.to_string()))?;
    let owned = Arc::new(Mutex::new(Vec::new()));
    let gate = Arc::new(Mutex::new(()));
    let snapshots = super::compaction::Snapshots {
        ledger: ledger.clone(),
        sub: ledger
            .subscriber(&subscription.subscriber)
            .map_err(|e| KafkaError::Ledger(e.to_string()))?,
        owned: owned.clone(),
        gate: gate.clone(),
        // A snapshot waits for one batch of its shard and that batch's acknowledgements.
        timeout: kafka.changelog.publish_timeout + Duration::from_secs(30),
    };
    let compactor =
        super::compaction::Compactor::new(kafka, sink.clone(), topic.clone(), Some(snapshots))?;
    let name: Arc<str> = subscription.subscriber.as_str().into();
    let counted = name.to_string();
    let compaction = super::compaction::CompactionThread::spawn(
        compactor,
        name,
        kafka.changelog.compaction_interval,
        owned.clone(),
        move |c| {
            stats
                .changelog_tombstones
                .fetch_add(c.tombstones, Ordering::Relaxed);
            stats
                .changelog_snapshots
                .fetch_add(c.snapshots, Ordering::Relaxed);
            metrics::counter!(crate::telemetry::metric::KAFKA_CHANGELOG_TOMBSTONES_TOTAL,
                "subscriber" => counted.clone())
            .increment(c.tombstones);
            metrics::counter!(crate::telemetry::metric::KAFKA_CHANGELOG_SNAPSHOTS_TOTAL,
                "subscriber" => counted.clone())
            .increment(c.snapshots);
        },
    )
    .map_err(|e| KafkaError::Client(format!("changelog compaction thread: {e}")))?;
    tracing::info!(subscriber = %subscription.subscriber, %topic, partitions,
        compaction_interval = ?kafka.changelog.compaction_interval,
        "changelog on: claims and handler state are published before each commit and restored on assignment");
    Ok(Changelog {
        kafka: kafka.clone(),
        topic,
        sink,
        acked,
        pending: Vec::new(),
        moved_to: HashMap::new(),
        last: Instant::now(),
        owned,
        gate,
        compaction: Some(compaction),
    })
}

/// One round of the consumer loop: take up to a burst of records, submit them, release
/// the outcomes that are ready; when idle, wait briefly for the next record.
fn poll_round(consumer: &BaseConsumer<WorkerContext>, name: &str) {
    let mut got = 0;
    let received_at_ms = now_ms();
    while got < BURST {
        match consumer.poll(Duration::ZERO) {
            Some(Ok(m)) => {
                consumer
                    .context()
                    .lock()
                    .accept(consumer, &m, received_at_ms);
                got += 1;
            }
            Some(Err(e)) => {
                tracing::warn!(subscriber = %name, "kafka consumer error: {e}");
                break;
            }
            None => break,
        }
    }
    let in_flight = {
        let mut w = consumer.context().lock();
        w.flush();
        w.retry_unsent(consumer);
        w.handle_ready(consumer);
        if got == 0 && w.any_in_flight() {
            w.wait_and_handle(consumer, Duration::from_millis(2));
        }
        w.any_in_flight()
    };
    if got == 0 && !in_flight {
        match consumer.poll(Duration::from_millis(50)) {
            Some(Ok(m)) => consumer.context().lock().accept(consumer, &m, now_ms()),
            Some(Err(e)) => tracing::warn!(subscriber = %name, "kafka consumer error: {e}"),
            None => {}
        }
    }
}

/// Graceful stop: no new messages; finish what is in flight (within `drain_timeout`),
/// store and commit the offsets.
fn drain_and_commit(
    consumer: &BaseConsumer<WorkerContext>,
    kafka: &KafkaConfig,
) -> Result<Option<Latency>, KafkaError> {
    let name = &consumer.context().subscriber;
    let mut w = consumer.context().lock();
    let deadline = Instant::now() + kafka.drain_timeout;
    let mut drained = w.drain(consumer, None, deadline);
    while drained && !w.unsent.is_empty() && Instant::now() < deadline {
        w.retry_unsent(consumer);
        drained = w.drain(consumer, None, deadline);
    }
    if let Some(f) = w.fatal.clone() {
        return Err(KafkaError::Ledger(f));
    }
    if !drained {
        tracing::error!(subscriber = %name, "in-flight messages did not finish within kafka.drain_timeout; they will be delivered again");
    } else {
        let slots: Vec<u64> = w.parts.keys().copied().collect();
        w.checkpoint(consumer, &slots);
    }
    commit(consumer, name, "final offset commit");
    Ok(w.latency.take())
}

/// Commits the stored offsets synchronously; "nothing stored since the last commit" is fine.
/// Commits the stored offsets; whether the coordinator took them (or there were none).
fn commit(consumer: &BaseConsumer<WorkerContext>, subscriber: &str, what: &str) -> bool {
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(())
        | Err(rdkafka::error::KafkaError::ConsumerCommit(
            rdkafka::types::RDKafkaErrorCode::NoOffset,
        )) => true,
        Err(e) => {
            tracing::warn!(
                subscriber,
                "{what} failed (retried with the next commit): {e}"
            );
            false
        }
    }
}

pub(super) fn consumer_config(
    kafka: &KafkaConfig,
    subscription: &SubscriptionConfig,
) -> ClientConfig {
    let mut c = super::client_config(kafka);
    let session_ms = kafka.session_timeout.as_millis().max(1);
    c.set("group.id", kafka.group_of(subscription))
        .set("enable.auto.offset.store", "false")
        .set("enable.auto.commit", "true")
        .set(
            "auto.commit.interval.ms",
            kafka.commit_interval.as_millis().max(1).to_string(),
        )
        .set("auto.offset.reset", kafka.start.as_librdkafka())
        .set("session.timeout.ms", session_ms.to_string())
        .set("heartbeat.interval.ms", (session_ms / 3).max(1).to_string())
        .set("enable.partition.eof", "false")
        .set("statistics.interval.ms", "5000");
    if !kafka.options.contains_key("partition.assignment.strategy") {
        // Incremental rebalancing: partitions that stay are never revoked, and the ones
        // that move are revoked while the group is stable, so the commit made before
        // releasing them is accepted (a group coordinator refuses commits while an eager
        // rebalance is in progress).
        c.set("partition.assignment.strategy", "cooperative-sticky");
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_encodes_slot_and_local_number() {
        let (slot, local) = (7u64, 123_456u64);
        let seq = (slot << LOCAL_BITS) | local;
        assert_eq!((seq >> LOCAL_BITS, seq & LOCAL_MASK), (slot, local));
    }
}
