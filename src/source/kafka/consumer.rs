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
//!
//! This file holds the worker (what the poll loop and the rebalance callback share) and
//! the way of a message: accepted, routed to its shard, its outcome, its offset stored.
//! Beside it:
//! - `run.rs`: the subscription's thread — starting the member, the poll loop, the stop
//!   that drains and commits;
//! - `rebalance.rs`: the consumer's context (librdkafka's rebalance, error and statistics
//!   callbacks, whether a broker is reachable) and assigning and revoking partitions;
//! - `changelog.rs`: the changelog side (`changelog = true`) — fences and restore on
//!   assignment, checkpoints, the outbox relayed before revoked partitions are released;
//! - `dead_letter.rs`: rejected input and dead letters, kept in the ledger and produced to
//!   the dead-letter topic.

mod changelog;
mod dead_letter;
mod rebalance;
mod run;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{select, Receiver, Sender};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::topic_partition_list::TopicPartitionList;

use crate::config::SubscriberSettings;
use crate::envelope::Envelope;
use crate::ledger::{Done, Job, Ledger, Origin, Outcome, Subscriber};
use crate::source::delivery::{route, Delivery, Keying, Routed, Target};
use crate::telemetry::Latency;

use super::keying::{self, raw_header_key_hash, RecordView};
use super::offsets::OffsetTracker;
use super::{KafkaConfig, SubscriptionConfig};
use changelog::{start_changelog, Changelog};
use dead_letter::{DeadLetterTopic, DeliveryContext};
use rebalance::{BrokerState, WorkerContext, BROKER_GRACE};
pub use run::{run_subscription, RunOptions};

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
    pub(crate) received: AtomicU64,
    /// Messages whose offsets were stored (outcome durable, dead letters delivered).
    pub released: AtomicU64,
    pub processed: AtomicU64,
    pub duplicate: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) rejected: AtomicU64,
    /// Partitions revoked from this member, and revocations whose drain timed out.
    pub revoked_partitions: AtomicU64,
    pub revoke_drain_timeouts: AtomicU64,
    /// Revocations whose commit the group coordinator refused (a rebalance in progress):
    /// the new owner starts from the last committed offset and, since instances do not
    /// share claims, processes again what this member processed after it.
    pub revoke_commit_failures: AtomicU64,
    /// Offsets stored (calls to `store_offsets`).
    pub(crate) offset_stores: AtomicU64,
    /// Partitions currently assigned to this member.
    pub(crate) assigned_partitions: AtomicU64,
    /// Rebalances after which another member of the group held partitions of a subscribed
    /// topic: instances do not share claims, so a partition that moves is processed again
    /// (docs/kafka.md, "Without a changelog: one instance per consumer group"). Not
    /// counted with a changelog.
    pub shared_group_rebalances: AtomicU64,
    /// Changes replayed from the changelog into the ledger on assignment (`changelog = true`).
    pub(crate) restored_changes: AtomicU64,
    /// Emitted messages a restore found in the changelog with no relay's tombstone and put
    /// back into this member's outbox.
    pub(crate) restored_emitted: AtomicU64,
    /// Quarantine and dead-letter records a restore found in the changelog and put into
    /// this member's ledger.
    pub(crate) restored_records: AtomicU64,
    /// Tombstones produced to the changelog for the records of expired claims.
    pub(crate) changelog_tombstones: AtomicU64,
    /// Snapshot records produced by changelog compaction.
    pub(crate) changelog_snapshots: AtomicU64,
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

/// Outcomes of one batch of `Done`s by kind, added to [`SourceStats`] and the metrics once
/// per batch. A failure is not counted: it stops the subscription (G7).
#[derive(Debug, Default)]
struct Counts {
    processed: u64,
    duplicate: u64,
    quarantined: u64,
    /// Dead-lettered, or rejected as unusable input: both are set aside as dead letters.
    dead_lettered: u64,
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
        let routed = route(
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
        let mut counts = Counts::default();
        let mut touched: Vec<u64> = Vec::new();
        for d in dones {
            let (slot, local) = (d.seq >> LOCAL_BITS, d.seq & LOCAL_MASK);
            if !self.parts.contains_key(&slot) {
                continue; // revoked: its offset is not ours to store
            }
            match d.outcome {
                Outcome::Processed => counts.processed += 1,
                Outcome::Duplicate => counts.duplicate += 1,
                // Kept in the ledger (admin lists and replays it), not sent to the topic.
                Outcome::Quarantined { .. } => counts.quarantined += 1,
                Outcome::DeadLettered { reason, attempts } => {
                    counts.dead_lettered += 1;
                    self.set_aside(consumer, slot, local, reason, attempts, &mut touched);
                    continue;
                }
                Outcome::Rejected { reason } => {
                    counts.dead_lettered += 1;
                    self.set_aside(consumer, slot, local, reason, 0, &mut touched);
                    continue;
                }
                Outcome::Failed { reason } => {
                    self.fatal = Some(reason);
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
        for (n, counter, name) in [
            (counts.processed, &s.processed, "processed"),
            (counts.duplicate, &s.duplicate, "duplicate"),
            (counts.quarantined, &s.quarantined, "quarantined"),
            (counts.dead_lettered, &s.dead_lettered, "dead_lettered"),
        ] {
            if n > 0 {
                counter.fetch_add(n, Ordering::Relaxed);
                metrics::counter!(crate::telemetry::metric::KAFKA_MESSAGES_TOTAL,
                    "subscriber" => self.sub.name.to_string(), "outcome" => name)
                .increment(n);
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

/// Commits the stored offsets synchronously; whether the coordinator took them ("nothing
/// stored since the last commit" counts as taken).
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
