//! The consumer's context and what a rebalance does to the worker.
//!
//! librdkafka calls [`WorkerContext`] from inside `poll` on the subscription's thread: its
//! rebalance callback assigns partitions (restoring the changelog first when there is one)
//! and revokes them (staged jobs submitted, outcomes awaited up to `drain_timeout`,
//! offsets stored and committed, then their state dropped); its error and statistics
//! callbacks keep [`BrokerState`] (whether a broker is reachable, for `/readyz`) and the
//! consumer-lag gauges.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaResult;
use rdkafka::statistics::Statistics;
use rdkafka::topic_partition_list::TopicPartitionList;
use rdkafka::ClientContext;

use super::*;

/// The consumer's context: rebalance callbacks and statistics.
pub(super) struct WorkerContext {
    pub(super) worker: Mutex<Worker>,
    pub(super) subscriber: Arc<str>,
    /// Since when and why no broker has been reachable (`None`: one is), for the
    /// subscription's `/readyz` probe.
    pub(super) brokers: Arc<BrokerState>,
}

/// Whether the subscription's consumer reaches a broker, as its callbacks last said.
pub(super) struct BrokerState(Mutex<Option<(String, Instant)>>);

/// How long no broker may be reachable before `/readyz` says so: a broker restart or a
/// leader election is shorter, and a probe that flaps on them does harm.
pub(super) const BROKER_GRACE: Duration = Duration::from_secs(10);

impl BrokerState {
    /// Not reached yet, as of now.
    pub(super) fn starting() -> BrokerState {
        BrokerState(Mutex::new(Some((
            "no Kafka broker reached yet".into(),
            Instant::now(),
        ))))
    }

    fn set(&self, down: Option<String>) {
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *s = match (down, s.take()) {
            (None, _) => None,
            // Still down: a new reason, the same start.
            (Some(why), Some((_, since))) => Some((why, since)),
            (Some(why), None) => Some((why, Instant::now())),
        };
    }

    /// The `/readyz` reason: no broker reachable for longer than `grace`.
    pub(super) fn probe(&self, grace: Duration) -> Option<String> {
        let s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (why, since) = s.as_ref()?;
        let down = since.elapsed();
        (down >= grace).then(|| format!("{why} (for {} s)", down.as_secs()))
    }
}

impl WorkerContext {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Worker> {
        self.worker.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl ClientContext for WorkerContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        crate::source::kafka::logging::log(level, fac, message);
    }

    /// librdkafka says "all brokers down" at once; `/readyz` fails after its grace period.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::AllBrokersDown) {
            self.brokers
                .set(Some(format!("no Kafka broker reachable: {reason}")));
        }
        crate::source::kafka::logging::error(&error, reason);
    }

    fn stats(&self, statistics: Statistics) {
        // Reachable while any broker connection is up (bootstrap entries included).
        let up = statistics.brokers.values().any(|b| b.state == "UP");
        if up {
            self.brokers.set(None);
        } else {
            let states: Vec<String> = statistics
                .brokers
                .values()
                .map(|b| format!("{} {}", b.nodename, b.state))
                .collect();
            self.brokers.set(Some(format!(
                "no Kafka broker reachable ({})",
                states.join(", ")
            )));
        }
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

impl Worker {
    pub(super) fn assign(&mut self, tpl: &TopicPartitionList) {
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

    pub(super) fn revoke(
        &mut self,
        consumer: &BaseConsumer<WorkerContext>,
        tpl: &TopicPartitionList,
    ) {
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
}
