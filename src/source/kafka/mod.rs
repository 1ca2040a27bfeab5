//! The Kafka source: the only module that imports rdkafka.
//!
//! - [`consumer`](run_subscription): one consumer-group member per configured
//!   subscription, offsets stored only up to each partition's durable watermark (G1),
//!   flush-before-revoke, backpressure by pausing partitions, dead-letter topic.
//! - [`outbox`](run_relay): relays handler outbox rows with an idempotent producer.
//! - [`DevBroker`]: librdkafka's mock cluster for development and tests.
//! - [`bench`](mod@bench): consume-only baseline against consume -> dedup -> handler -> offsets.
//!
//! Dead letters on the topic carry the original key, payload and headers plus
//! `dedupd-subscriber`, `dedupd-reason`, `dedupd-attempts` (0 for rejected input),
//! `dedupd-original-topic`, `dedupd-original-partition` and `dedupd-original-offset`.
//! Quarantined messages stay in the ledger only (the admin API lists and replays them).

pub mod bench;
mod broker;
mod config;
mod consumer;
mod keying;
mod offsets;
mod outbox;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdkafka::config::ClientConfig;

pub use broker::DevBroker;
pub use config::{KafkaConfig, OutboxRelayConfig, StartPosition, SubscriptionConfig};
pub use consumer::{run_subscription, RunOptions, SourceStats};
pub use keying::{key_record, Keyed, RecordView};
pub use offsets::{OffsetTracker, Released};
pub use outbox::{run_relay, RelayStats};

use crate::ledger::Ledger;

/// Why the Kafka source stopped.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// A Kafka client could not be created or used; check `kafka.brokers` and
    /// `kafka.options`.
    #[error("kafka client error: {0}")]
    Client(String),
    /// The ledger failed (G7): nothing more was acknowledged; restart after fixing it.
    #[error("the ledger stopped: {0}")]
    Ledger(String),
    /// The section is missing or unusable.
    #[error("{0}")]
    Config(String),
}

/// Options every client gets: brokers and the raw passthrough options.
fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &kafka.brokers);
    for (k, v) in &kafka.options {
        c.set(k, v);
    }
    c
}

/// An idempotent producer (dead letters, outbox).
fn producer_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut c = client_config(kafka);
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5");
    c
}

/// What a stopped Kafka source did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct KafkaSummary {
    pub received: u64,
    pub released: u64,
    pub processed: u64,
    pub duplicate: u64,
    pub quarantined: u64,
    pub dead_lettered: u64,
    pub rejected: u64,
    pub revoked_partitions: u64,
    pub outbox_relayed: u64,
}

impl KafkaSummary {
    fn add(&mut self, s: &SourceStats) {
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        self.received += get(&s.received);
        self.released += get(&s.released);
        self.processed += get(&s.processed);
        self.duplicate += get(&s.duplicate);
        self.quarantined += get(&s.quarantined);
        self.dead_lettered += get(&s.dead_lettered);
        self.rejected += get(&s.rejected);
        self.revoked_partitions += get(&s.revoked_partitions);
    }
}

/// Runs every configured subscription and the outbox relay until `stop` is set; then the
/// consumers drain, store and commit their offsets, and the relay empties the outbox.
/// The first failure stops everything else too.
pub fn run(
    ledger: Arc<Ledger>,
    kafka: &KafkaConfig,
    stop: &AtomicBool,
) -> Result<KafkaSummary, KafkaError> {
    if kafka.subscriptions.is_empty() && !kafka.outbox.enabled {
        return Err(KafkaError::Config(
            "`kafka` has no `subscription` and the outbox relay is disabled: nothing to run".into(),
        ));
    }
    let failed = AtomicBool::new(false);
    let relay_stop = AtomicBool::new(false);
    let relay_stats = RelayStats::default();
    let stats: Vec<Arc<SourceStats>> = kafka
        .subscriptions
        .iter()
        .map(|_| Arc::new(SourceStats::default()))
        .collect();
    // Consumers watch one flag, set when the caller asks or any part failed.
    let internal = AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        let relay = kafka.outbox.enabled.then(|| {
            let ledger = ledger.clone();
            let (relay_stop, relay_stats, failed) = (&relay_stop, &relay_stats, &failed);
            std::thread::Builder::new()
                .name("dedupd-outbox-relay".into())
                .spawn_scoped(scope, move || {
                    let r = run_relay(&ledger, kafka, relay_stop, relay_stats);
                    if r.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    r
                })
        });
        let mut consumers = Vec::new();
        for (sub, st) in kafka.subscriptions.iter().zip(&stats) {
            let ledger = ledger.clone();
            let st = st.clone();
            let (internal, failed) = (&internal, &failed);
            consumers.push(
                std::thread::Builder::new()
                    .name(format!("dedupd-kafka-{}", sub.subscriber))
                    .spawn_scoped(scope, move || {
                        let r = run_subscription(
                            ledger,
                            kafka,
                            sub,
                            internal,
                            st,
                            &RunOptions::default(),
                        );
                        if r.is_err() {
                            failed.store(true, Ordering::Relaxed);
                        }
                        r.map(|_| ())
                    }),
            );
        }
        loop {
            if stop.load(Ordering::Relaxed) || failed.load(Ordering::Relaxed) {
                internal.store(true, Ordering::Relaxed);
            }
            let running = consumers
                .iter()
                .any(|c| c.as_ref().is_ok_and(|h| !h.is_finished()));
            if !running && internal.load(Ordering::Relaxed) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let mut first_err = None;
        for c in consumers {
            let r = match c {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|_| Err(KafkaError::Client("consumer thread panicked".into()))),
                Err(e) => Err(KafkaError::Client(format!(
                    "cannot start consumer thread: {e}"
                ))),
            };
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        // Consumers are done: whatever their handlers emitted is in the outbox now.
        relay_stop.store(true, Ordering::Relaxed);
        if let Some(r) = relay {
            let r = match r {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|_| Err(KafkaError::Client("outbox relay panicked".into()))),
                Err(e) => Err(KafkaError::Client(format!(
                    "cannot start outbox relay: {e}"
                ))),
            };
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    });
    result?;
    let mut summary = KafkaSummary::default();
    for s in &stats {
        summary.add(s);
    }
    summary.outbox_relayed = relay_stats.relayed.load(Ordering::Relaxed);
    Ok(summary)
}
