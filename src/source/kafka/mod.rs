//! The Kafka source: the only module that imports rdkafka.
//!
//! - [`consumer`](run_subscription): one consumer-group member per configured
//!   subscription, offsets stored only up to each partition's durable watermark (G1),
//!   flush-before-revoke, backpressure by pausing partitions, dead-letter topic
//!   (`consumer.rs`; in `consumer/`: the subscription's thread `run.rs`, the changelog
//!   side `changelog.rs`, `dead_letter.rs`). [`keying`] derives a record's key and routing
//!   hash, `OffsetTracker` holds each partition's watermark.
//! - [`changelog`] (`changelog = true`): claims and handler state that follow their
//!   partitions between members — the record format, the producer with its fences, the
//!   topic, restore and checkpoints (`changelog/`); `compaction` snapshots state and
//!   tombstones the records of expired claims.
//! - `outbox`: relays handler outbox rows with an idempotent producer.
//! - [`DevBroker`]: librdkafka's mock cluster for development and tests.
//! - `check_clients`: the options checked by creating the clients, without connecting.
//! - `logging.rs`: librdkafka's log lines and errors at a bounded rate; broker
//!   reachability goes to `/readyz` through `crate::source::readiness`.
//! - [`bench`](mod@bench): consume-only baseline against consume -> dedup -> handler -> offsets.
//!
//! Dead letters on the topic carry the original key, payload and headers plus
//! `dedupd-subscriber`, `dedupd-reason`, `dedupd-attempts` (0 for rejected input),
//! `dedupd-original-topic`, `dedupd-original-partition` and `dedupd-original-offset`.
//! Quarantined messages stay in the ledger only (the admin API lists and replays them).

pub mod bench;
mod broker;
pub mod changelog;
mod check;
pub(crate) mod compaction;
mod config;
mod consumer;
pub mod keying;
mod logging;
mod offsets;
mod outbox;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError as RdError;

pub use crate::source::relay::RelayStats;
pub use broker::DevBroker;
pub(crate) use check::check_clients;
pub use config::{KafkaConfig, SubscriptionConfig};
pub use consumer::{run_subscription, RunOptions, SourceStats};
pub use keying::RecordView;
pub(crate) use outbox::run_relay;

pub(crate) use changelog::ChangelogError;

use crate::ledger::{Ledger, LedgerError};
use crate::pipeline::{Cause, Shutdown};

/// Why the Kafka source stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// A Kafka client could not be created or used; check `kafka.brokers` and
    /// `kafka.options`.
    #[error("kafka client error: {what}: {source}")]
    Client {
        /// What the client was doing (`metadata of orders`, `changelog producer`).
        what: String,
        #[source]
        source: RdError,
    },
    /// A subscription's changelog topic is missing and the broker did not create it.
    #[error("kafka client error: changelog topic {topic} is missing and creating it failed: {source}; create it with {partitions} partitions and cleanup.policy=compact, or let dedupd create it (CreateTopics, the cluster's ACLs permitting)")]
    TopicCreation {
        topic: String,
        partitions: usize,
        #[source]
        source: RdError,
    },
    /// The runtime the admin client's requests run on could not be built.
    #[error("kafka client error: admin runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A thread of the source could not be started.
    #[error("kafka client error: cannot start {what} thread: {source}")]
    Spawn {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A thread of the source panicked.
    #[error("kafka client error: {what} thread panicked")]
    Panicked { what: &'static str },
    /// A changelog could not be published to or restored from.
    #[error("kafka client error: {what}: {source}")]
    Changelog {
        /// Where (`my-changelog partition 3 offset 17`, `tombstones to my-changelog/3`).
        what: String,
        #[source]
        source: Box<ChangelogError>,
    },
    /// Restoring from a changelog took longer than it may.
    #[error("kafka client error: restoring from {topic} took longer than kafka.changelog.restore_timeout ({timeout:?}); {replayed} changes replayed")]
    RestoreTimeout {
        topic: String,
        timeout: std::time::Duration,
        replayed: u64,
    },
    /// The ledger failed (G7): nothing more was acknowledged; restart after fixing it.
    #[error("the ledger stopped: {0}")]
    Ledger(#[from] LedgerError),
    /// The ledger failed a job of this source (G7), for the reason it gave the job:
    /// nothing more was acknowledged; restart after fixing it.
    #[error("the ledger stopped: {reason}")]
    Failed { reason: String },
    /// The ledger failed a job that snapshots a changelog partition's state.
    #[error("the ledger stopped: snapshot of {topic}/{partition}: {reason}")]
    SnapshotFailed {
        topic: String,
        partition: i32,
        reason: String,
    },
    /// Snapshot jobs were not committed within the changelog's publish timeout.
    #[error("the ledger stopped: {left} of {jobs} snapshots of {topic}/{partition} not committed within {timeout:?}")]
    SnapshotsLate {
        left: u64,
        jobs: u64,
        topic: String,
        partition: i32,
        timeout: std::time::Duration,
    },
    /// The ledger stopped reporting the outcomes of a restore's jobs.
    #[error("the ledger stopped: restore outcomes stopped arriving")]
    RestoreStalled,
    /// The section is missing or unusable.
    #[error(transparent)]
    Config(#[from] KafkaConfigError),
}

/// What is wrong with the `[kafka]` section, or with the topics it names.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaConfigError {
    #[error("`kafka` has no `subscription` and the outbox relay is disabled: nothing to run")]
    NothingToRun,
    #[error("a subscription with a changelog needs one topic")]
    ChangelogTopics,
    #[error("topic {input} does not exist (yet): a changelog is created with the input topic's partition count, so create {input} first")]
    NoInputTopic { input: String },
    #[error("changelog topic {topic} has {found} partitions but {input} has {partitions}: partition p of the changelog holds the changes of partition p of the input, so it needs at least as many")]
    ChangelogPartitions {
        topic: String,
        found: usize,
        input: String,
        partitions: usize,
    },
    /// librdkafka refused one of `kafka.options`.
    #[error("kafka.options.{key:?}: {detail}")]
    Option { key: String, detail: String },
    /// librdkafka refused an option dedupd set from the section.
    #[error("kafka: librdkafka refused {key:?} = {value:?} (set by dedupd from the [kafka] section): {detail}")]
    Derived {
        key: String,
        value: String,
        detail: String,
    },
    /// librdkafka cannot create a client with the options as a whole.
    #[error("kafka.options: librdkafka cannot create a {client} with these options: {detail}")]
    Client {
        client: &'static str,
        detail: String,
    },
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
    pub(crate) received: u64,
    pub(crate) released: u64,
    pub processed: u64,
    pub duplicate: u64,
    pub(crate) quarantined: u64,
    pub dead_lettered: u64,
    pub rejected: u64,
    pub(crate) revoked_partitions: u64,
    /// Revocations whose commit was refused (see [`SourceStats::revoke_commit_failures`]).
    pub(crate) revoke_commit_failures: u64,
    /// Rebalances after which other members of the group held partitions (see
    /// [`SourceStats::shared_group_rebalances`]).
    pub shared_group_rebalances: u64,
    /// Changes replayed from changelogs on assignment (`changelog = true`).
    pub(crate) restored_changes: u64,
    /// Emitted messages put back into the outbox by restores (see
    /// [`SourceStats::restored_emitted`]).
    pub(crate) restored_emitted: u64,
    /// Quarantine and dead-letter records put into the ledger by restores (see
    /// [`SourceStats::restored_records`]).
    pub(crate) restored_records: u64,
    /// Tombstones produced by changelog compaction.
    pub(crate) changelog_tombstones: u64,
    /// Snapshot records produced by changelog compaction.
    pub(crate) changelog_snapshots: u64,
    pub(crate) outbox_relayed: u64,
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
        self.revoke_commit_failures += get(&s.revoke_commit_failures);
        self.shared_group_rebalances += get(&s.shared_group_rebalances);
        self.restored_changes += get(&s.restored_changes);
        self.restored_emitted += get(&s.restored_emitted);
        self.restored_records += get(&s.restored_records);
        self.changelog_tombstones += get(&s.changelog_tombstones);
        self.changelog_snapshots += get(&s.changelog_snapshots);
    }
}

/// Runs every configured subscription and the outbox relay until `shutdown` triggers;
/// then the consumers drain, store and commit their offsets, and the relay empties the
/// outbox. The first failure triggers `shutdown`, so everything else stops too.
pub fn run(
    ledger: Arc<Ledger>,
    kafka: &KafkaConfig,
    shutdown: &Shutdown,
) -> Result<KafkaSummary, KafkaError> {
    if kafka.subscriptions.is_empty() && !kafka.outbox.enabled {
        return Err(KafkaConfigError::NothingToRun.into());
    }
    let relay_stop = AtomicBool::new(false);
    let relay_stats = RelayStats::default();
    let stats: Vec<Arc<SourceStats>> = kafka
        .subscriptions
        .iter()
        .map(|_| Arc::new(SourceStats::default()))
        .collect();
    let failed = |e: &KafkaError| shutdown.trigger(Cause::Failed(e.to_string()));
    let result = std::thread::scope(|scope| {
        let relay = kafka.outbox.enabled.then(|| {
            let ledger = ledger.clone();
            let (relay_stop, relay_stats) = (&relay_stop, &relay_stats);
            std::thread::Builder::new()
                .name("dedupd-outbox-relay".into())
                .spawn_scoped(scope, move || {
                    run_relay(&ledger, kafka, relay_stop, relay_stats).inspect_err(failed)
                })
        });
        let consumers: Vec<_> = kafka
            .subscriptions
            .iter()
            .zip(&stats)
            .map(|(sub, st)| {
                let (ledger, st) = (ledger.clone(), st.clone());
                std::thread::Builder::new()
                    .name(format!("dedupd-kafka-{}", sub.subscriber))
                    .spawn_scoped(scope, move || {
                        let opts = RunOptions::default();
                        run_subscription(ledger, kafka, sub, shutdown.flag(), st, &opts)
                            .map(|_| ())
                            .inspect_err(failed)
                    })
            })
            .collect();
        if consumers.iter().any(|c| c.is_err()) {
            shutdown.trigger(Cause::Failed("cannot start a consumer thread".into()));
        }
        shutdown.wait();
        let mut first_err = None;
        for c in consumers {
            if let Err(e) = joined(c, "consumer") {
                first_err.get_or_insert(e);
            }
        }
        // Consumers are done: whatever their handlers emitted is in the outbox now.
        relay_stop.store(true, Ordering::Relaxed);
        if let Some(r) = relay {
            if let Err(e) = joined(r, "outbox relay") {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    });
    result?;
    let mut summary = KafkaSummary::default();
    for s in &stats {
        summary.add(s);
    }
    summary.outbox_relayed = relay_stats.relayed.load(Ordering::Relaxed);
    Ok(summary)
}

/// The result of a scoped thread that was (or could not be) started.
fn joined<T>(
    spawned: std::io::Result<std::thread::ScopedJoinHandle<'_, Result<T, KafkaError>>>,
    what: &'static str,
) -> Result<T, KafkaError> {
    match spawned {
        Ok(handle) => handle
            .join()
            .unwrap_or_else(|_| Err(KafkaError::Panicked { what })),
        Err(source) => Err(KafkaError::Spawn { what, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an operator reads when the source stops: what failed, where, and why, with
    /// the cause's own text (kept as its `source` too).
    #[test]
    fn a_stopped_source_says_what_failed_and_where() {
        let record = KafkaError::Changelog {
            what: "dedupd-orders-changelog partition 3 offset 17".into(),
            source: Box::new(changelog::RecordError::Empty.into()),
        };
        assert_eq!(
            record.to_string(),
            "kafka client error: dedupd-orders-changelog partition 3 offset 17: an empty record"
        );
        assert!(std::error::Error::source(&record).is_some());
        let refused = KafkaError::TopicCreation {
            topic: "dedupd-orders-changelog".into(),
            partitions: 4,
            source: RdError::AdminOp(rdkafka::types::RDKafkaErrorCode::TopicAuthorizationFailed),
        };
        let text = refused.to_string();
        assert!(
            text.starts_with("kafka client error: changelog topic dedupd-orders-changelog is missing and creating it failed: "),
            "{text}"
        );
        assert!(text.contains("authorization"), "{text}");
        assert!(
            text.ends_with("; create it with 4 partitions and cleanup.policy=compact, or let dedupd create it (CreateTopics, the cluster's ACLs permitting)"),
            "{text}"
        );
        let ledger = KafkaError::from(LedgerError::Poisoned("disk full".into()));
        assert_eq!(
            ledger.to_string(),
            "the ledger stopped: the ledger is stopped after an earlier failure: disk full"
        );
        let config = KafkaError::from(KafkaConfigError::NoInputTopic {
            input: "orders".into(),
        });
        assert_eq!(
            config.to_string(),
            "topic orders does not exist (yet): a changelog is created with the input topic's partition count, so create orders first"
        );
    }
}
