//! The thread of one subscription: starting its consumer-group member (the consumer, the
//! dead-letter producer, the changelog), the poll loop, and the stop that drains in-flight
//! work and commits the offsets.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::ThreadedProducer;

use super::{
    commit, consumer_config, now_ms, start_changelog, BrokerState, DeadLetterTopic,
    DeliveryContext, SourceStats, Worker, WorkerContext, BROKER_GRACE, BURST,
};
use crate::ledger::{Done, Ledger};
use crate::source::kafka::{producer_config, KafkaConfig, KafkaError, SubscriptionConfig};
use crate::source::readiness;
use crate::telemetry::Latency;

/// Settings of one running subscription that a config file does not carry.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Record the latency from each message's produce timestamp to its offset being
    /// stored (the benchmark's end-to-end figure).
    pub(crate) record_latency: bool,
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
    // `/readyz` fails while no broker has been reachable for the grace period.
    let brokers = consumer.context().brokers.clone();
    let _probe = readiness::register(
        &format!(
            "kafka subscriber {} (topics {})",
            consumer.context().subscriber,
            subscription.topics.join(", ")
        ),
        Arc::new(move || brokers.probe(BROKER_GRACE)),
    );
    let name = consumer.context().subscriber.clone();
    let mut last_log = Instant::now();
    let mut last_released = 0;
    while !stop.load(Ordering::Relaxed) {
        if let Some(f) = consumer.context().lock().fatal.clone() {
            return Err(KafkaError::Failed { reason: f });
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
    let sub = ledger.subscriber(&subscription.subscriber)?;
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    let dlq = match &kafka.dead_letter_topic {
        Some(topic) => {
            let (tx, reports) = unbounded();
            let producer: ThreadedProducer<DeliveryContext> = producer_config(kafka)
                .create_with_context(DeliveryContext { tx })
                .map_err(|source| KafkaError::Client {
                    what: format!("dead-letter producer for {topic}"),
                    source,
                })?;
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
        brokers: Arc::new(BrokerState::starting()),
    };
    let consumer: BaseConsumer<WorkerContext> = consumer_config(kafka, subscription)
        .create_with_context(ctx)
        .map_err(|source| KafkaError::Client {
            what: format!("consumer of subscriber {}", sub.name),
            source,
        })?;
    if subscription.changelog {
        let changelog = start_changelog(&consumer, &ledger, kafka, subscription, stats)?;
        consumer.context().lock().changelog = Some(changelog);
    }
    let topics: Vec<&str> = subscription.topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topics)
        .map_err(|source| KafkaError::Client {
            what: format!("subscribing to {}", topics.join(", ")),
            source,
        })?;
    tracing::info!(subscriber = %sub.name, group = kafka.group_of(subscription), ?topics, "kafka consumer started");
    Ok(consumer)
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
                super::super::logging::consumer_error(name, &e);
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
            Some(Err(e)) => super::super::logging::consumer_error(name, &e),
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
        return Err(KafkaError::Failed { reason: f });
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
