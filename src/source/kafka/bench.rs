//! `dedupd kafka-bench`: the Kafka source against a consume-only baseline, in one run.
//!
//! librdkafka's mock broker keeps only the newest 5 MB of each partition, so a topic of
//! 2M messages cannot be produced up front. Each phase therefore produces its `messages`
//! generated OrderPlaced events (fixed seed, `dup_rate` redeliveries; record key = order
//! id, header `message-id` = event id) to its own 4-partition topic *while* it consumes,
//! the producer never more than `WINDOW` messages ahead of the consumer. Both phases
//! carry the same producer load on the same machine:
//!
//! 1. Baseline: a plain rdkafka consumer reads every message (no processing, no offsets).
//! 2. Engine: the Kafka source reads every message: dedup, handler, durable commit,
//!    offsets stored. Throughput is timed from the first message received to the last
//!    message read (baseline) or the last offset stored (engine).
//! 3. Live: events are produced at half the engine's rate; the latency from each message's
//!    produce timestamp to its offset being stored is the end-to-end figure (in phase 2 it
//!    also counts the time a message waits in the producer's lead).

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use serde::Serialize;

use crate::bench::params::{self, ParamError};
use crate::clock::SystemClock;
use crate::config::{Config, KeySource, PartitionSource, SubscriberConfig};
use crate::ledger::{Ledger, LedgerError};
use crate::source::generator::{Event, Traffic, TrafficSpec};

use super::{
    run_subscription, DevBroker, KafkaConfig, KafkaError, RunOptions, SourceStats,
    SubscriptionConfig,
};

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct KafkaBenchParams {
    pub messages: u64,
    pub dup_rate: f64,
    pub seed: u64,
    pub partitions: i32,
    /// Messages of the live (paced) phase; 0 skips it.
    pub live_messages: u64,
    pub handler: Option<PathBuf>,
    /// Shards (default: number of cores).
    pub shards: Option<usize>,
    /// Directory for the temporary data directory.
    pub dir: PathBuf,
    /// An existing cluster instead of the built-in mock broker.
    pub brokers: Option<String>,
    /// Subscriptions publish a changelog (`changelog = true`); a restore phase then
    /// replays it into an empty data directory.
    pub changelog: bool,
    /// Claims expire this long after processing (with `changelog`, compaction every second).
    #[serde(with = "humantime_serde")]
    pub ttl: Option<Duration>,
}

impl KafkaBenchParams {
    /// Refuses parameters the run cannot use: `dup_rate` in [0, 1), `messages` and
    /// `partitions` at least 1, a `handler` that exists. [`run`] calls it first.
    pub fn validate(&self) -> Result<(), ParamError> {
        params::fraction("dup_rate", self.dup_rate)?;
        params::at_least_one("messages", self.messages)?;
        params::at_least_one("partitions", self.partitions)?;
        params::handler_built(self.handler.as_deref())
    }
}

/// Progress of a phase.
#[derive(Debug, Clone, Copy)]
pub struct BenchProgress {
    pub(crate) phase: &'static str,
    pub(crate) done: u64,
    pub(crate) total: u64,
    pub(crate) elapsed: Duration,
}

/// The figures.
#[derive(Debug, Clone, Serialize)]
pub struct KafkaBenchReport {
    pub(crate) params: KafkaBenchParams,
    pub(crate) baseline_msgs_per_sec: f64,
    pub(crate) baseline_s: f64,
    pub(crate) engine_msgs_per_sec: f64,
    pub(crate) engine_s: f64,
    /// engine / baseline.
    pub(crate) ratio: f64,
    pub(crate) processed: u64,
    pub(crate) duplicate: u64,
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
    /// Produce timestamp -> offset stored in phase 2 (includes the producer's lead).
    pub(crate) backlog_p99_ms: f64,
    /// Live phase: rate produced and latency from produce timestamp to offset stored.
    pub(crate) live_rate: f64,
    pub(crate) live_p50_ms: f64,
    pub(crate) live_p99_ms: f64,
    pub(crate) live_max_ms: f64,
    /// With `--changelog`: partition 0 restored alone into an empty data directory (a
    /// member taking it over), then the others; every restored claim is checked.
    pub(crate) takeover_changes: u64,
    pub(crate) takeover_s: f64,
    pub(crate) restore_changes: u64,
    pub(crate) restore_s: f64,
    pub(crate) restore_changes_per_sec: f64,
    /// Why the restore phase did not run (with `--changelog`).
    pub(crate) restore_skipped: Option<String>,
    /// Tombstones the engine phase sent for expired claims (with `--changelog --ttl`).
    pub(crate) changelog_tombstones: u64,
    /// Snapshot records compaction published for the handler state of expired claims.
    pub(crate) changelog_snapshots: u64,
}

/// Most messages the producer may be ahead of the consumer: in the engine phase, of the
/// offsets stored, so even a paused partition stays well inside the mock broker's 5 MB
/// per partition (about 8k messages per partition on average).
pub(crate) const WINDOW: u64 = 32_768;

impl std::fmt::Display for KafkaBenchParams {
    /// The line `dedupd kafka-bench` starts with.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let handler = match &self.handler {
            Some(h) => h.display().to_string(),
            None => "none".into(),
        };
        let ttl = self.ttl.map_or("default".into(), |t| {
            humantime::format_duration(t).to_string()
        });
        write!(f, "kafka-bench: {} messages, dup rate {}, seed {}, {} partitions, handler {handler}, changelog {}, ttl {ttl}, then {} paced messages for end-to-end latency",
            self.messages, self.dup_rate, self.seed, self.partitions, if self.changelog { "on" } else { "off" }, self.live_messages)
    }
}

impl std::fmt::Display for BenchProgress {
    /// One live line (without the carriage return).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rate = self.done as f64 / self.elapsed.as_secs_f64().max(1e-9);
        write!(
            f,
            "{:>8} {:>5.1}%  {:>10} msgs  {:>9.0} msgs/s",
            self.phase,
            100.0 * self.done as f64 / self.total.max(1) as f64,
            self.done,
            rate
        )
    }
}

impl std::fmt::Display for KafkaBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self;
        writeln!(
            f,
            "baseline  {:>12.0} msgs/s  consume only, producing alongside ({:.2} s)",
            r.baseline_msgs_per_sec, r.baseline_s
        )?;
        writeln!(f, "engine    {:>12.0} msgs/s  consume -> dedup -> handler -> offsets stored, producing alongside ({:.2} s)", r.engine_msgs_per_sec, r.engine_s)?;
        writeln!(f, "ratio     {:>12.2}x  engine / baseline", r.ratio)?;
        writeln!(
            f,
            "outcomes  processed {}  duplicate {}  quarantined {}  dead-lettered {}",
            r.processed, r.duplicate, r.quarantined, r.dead_lettered
        )?;
        writeln!(f, "lead      p99 {:.1} ms from produce timestamp to offset stored (producer up to {} messages ahead)", r.backlog_p99_ms, WINDOW)?;
        if r.params.live_messages > 0 {
            writeln!(f, "live      {:.0} msgs/s paced: produce timestamp -> offset stored p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms", r.live_rate, r.live_p50_ms, r.live_p99_ms, r.live_max_ms)?;
        }
        if r.params.changelog && r.params.ttl.is_some() {
            writeln!(
                f,
                "compacted {:>12} tombstones sent for expired claims, {} snapshot records for the state they wrote, during the engine phase",
                r.changelog_tombstones, r.changelog_snapshots
            )?;
        }
        if let Some(why) = &r.restore_skipped {
            writeln!(f, "restore   skipped: {why}")?;
        } else if r.params.changelog {
            writeln!(f, "takeover  partition 0 restored from the changelog into an empty data directory: {} changes in {:.2} s", r.takeover_changes, r.takeover_s)?;
            writeln!(f, "restore   {:>12.0} changes/s  all partitions, {} changes in {:.2} s, every claim checked", r.restore_changes_per_sec, r.restore_changes, r.restore_s)?;
        }
        Ok(())
    }
}

/// `fetch.wait.max.ms` of both consumers. The mock broker holds an empty fetch for the
/// whole wait instead of answering when data arrives (a real broker answers at once), so
/// librdkafka's default of 500 ms would be measured as end-to-end latency.
const FETCH_WAIT_MS: &str = "10";

/// Why `dedupd kafka-bench` stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaBenchError {
    /// The Kafka source under test failed.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// The benchmark's own producer or consumer failed.
    #[error("kafka client error: {0}")]
    Client(#[from] RdError),
    #[error("the ledger stopped: {0}")]
    Ledger(#[from] LedgerError),
    #[error("kafka client error: cannot create a data directory: {0}")]
    DataDir(#[source] std::io::Error),
    #[error("cannot load the handler: {0}")]
    Handler(#[source] Box<crate::pipeline::RunError>),
    #[error("kafka client error: no broker")]
    NoBroker,
    /// A parameter out of range, refused before anything starts.
    #[error(transparent)]
    Params(#[from] ParamError),
    #[error("kafka client error: the {0} panicked")]
    Panicked(&'static str),
    #[error("kafka client error: the consumer got no partitions in 60 s")]
    NoPartitions,
    #[error("kafka client error: the baseline consumer read {read} of {total} messages")]
    BaselineShort { read: u64, total: u64 },
    #[error("kafka client error: no progress for 60 s at {stored} of {total} offsets stored")]
    NoProgress { stored: u64, total: u64 },
    #[error(
        "kafka client error: the Kafka source stopped or stalled after {stored} of {total} offsets"
    )]
    Stalled { stored: u64, total: u64 },
    #[error("kafka client error: restore check failed: {changes} changes for {processed} processed messages, {restored} claims restored of {original}")]
    RestoreCheck {
        changes: u64,
        processed: u64,
        restored: u64,
        original: u64,
    },
    #[error("the ledger stopped: the ledger is still in use")]
    LedgerInUse,
}

/// Serves delivery reports, then sleeps. `BaseProducer::poll(timeout)` loops until its
/// deadline and hands librdkafka the remaining time in whole milliseconds, so the last
/// millisecond of every wait is a busy spin (all of a 1 ms wait): measured, the benchmark's
/// producer spun most of a core while waiting for the consumer, CPU the engine under test
/// needed on a 2-core machine.
fn idle(producer: &BaseProducer, pause: Duration) {
    producer.poll(Duration::ZERO);
    std::thread::sleep(pause);
}

/// Produces `spec`'s events to `topic`, at most `rate` per second when given.
fn produce(
    brokers: &str,
    topic: &str,
    spec: TrafficSpec,
    rate: Option<f64>,
    consumed: &AtomicU64,
    stop: &AtomicBool,
) -> Result<f64, KafkaBenchError> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", if rate.is_some() { "1" } else { "20" })
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "500000")
        .set("compression.type", "none")
        .create()
        .map_err(KafkaBenchError::Client)?;
    let mut traffic = Traffic::new(spec);
    let mut ev = Event::default();
    let mut key = String::new();
    let start = Instant::now();
    let mut n = 0u64;
    while traffic.next_into(&mut ev) {
        while n >= consumed.load(Ordering::Relaxed) + WINDOW {
            if stop.load(Ordering::Relaxed) {
                return Ok(0.0);
            }
            idle(&producer, Duration::from_millis(1));
        }
        if let Some(r) = rate {
            let due = start + Duration::from_secs_f64(n as f64 / r);
            let now = Instant::now();
            if due > now {
                producer.poll(Duration::ZERO);
                std::thread::sleep(due - now);
            }
        }
        key.clear();
        key.push_str("o-");
        key.push_str(&ev.order.to_string());
        loop {
            let headers = OwnedHeaders::new_with_capacity(1).insert(Header {
                key: "message-id",
                value: Some(ev.id.as_bytes()),
            });
            let record = BaseRecord::to(topic)
                .key(key.as_str())
                .payload(ev.payload.as_slice())
                .headers(headers);
            match producer.send(record) {
                Ok(()) => break,
                Err((RdError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    idle(&producer, Duration::from_millis(1));
                }
                Err((e, _)) => return Err(e.into()),
            }
        }
        n += 1;
        if n.is_multiple_of(1024) {
            producer.poll(Duration::ZERO);
        }
    }
    producer
        .flush(Duration::from_secs(120))
        .map_err(KafkaBenchError::Client)?;
    Ok(n as f64 / start.elapsed().as_secs_f64().max(1e-9))
}

/// Reads `total` messages with a plain consumer while they are produced; returns seconds
/// from the first message to the last.
fn baseline(
    brokers: &str,
    topic: &str,
    spec: TrafficSpec,
    progress: &mut dyn FnMut(BenchProgress),
) -> Result<f64, KafkaBenchError> {
    let total = spec.messages;
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "dedupd-bench-baseline")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .set("fetch.wait.max.ms", FETCH_WAIT_MS)
        .create()
        .map_err(KafkaBenchError::Client)?;
    consumer
        .subscribe(&[topic])
        .map_err(KafkaBenchError::Client)?;
    let consumed = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let producer = scope.spawn(|| produce(brokers, topic, spec, None, &consumed, &stop));
        let mut n = 0u64;
        let mut bytes = 0usize;
        let mut first: Option<Instant> = None;
        let mut last = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(900);
        let mut outcome = Ok(());
        while n < total {
            if Instant::now() > deadline || producer.is_finished() && n == 0 {
                outcome = Err(KafkaBenchError::BaselineShort { read: n, total });
                break;
            }
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    first.get_or_insert_with(Instant::now);
                    bytes += m.payload_len();
                    n += 1;
                    if n.is_multiple_of(256) {
                        consumed.store(n, Ordering::Relaxed);
                    }
                }
                Some(Err(e)) => tracing::warn!("baseline consumer: {e}"),
                None => {}
            }
            if last.elapsed() >= Duration::from_millis(500) {
                last = Instant::now();
                progress(BenchProgress {
                    phase: "baseline",
                    done: n,
                    total,
                    elapsed: first.map(|f| f.elapsed()).unwrap_or_default(),
                });
            }
        }
        let secs = first.map(|f| f.elapsed().as_secs_f64()).unwrap_or(0.0);
        stop.store(true, Ordering::Relaxed);
        std::hint::black_box(bytes);
        producer
            .join()
            .unwrap_or_else(|_| Err(KafkaBenchError::Panicked("producer")))?;
        outcome.map(|()| secs)
    })
}

/// Runs the Kafka source on `topic` until `total` offsets are stored.
#[allow(
    clippy::too_many_arguments,
    reason = "the parts of one run, passed once"
)]
fn engine(
    ledger: &Arc<Ledger>,
    kafka: &KafkaConfig,
    subscriber: &str,
    topic: &str,
    total: u64,
    phase: &'static str,
    spec: TrafficSpec,
    rate: Option<f64>,
    changelog: bool,
    progress: &mut dyn FnMut(BenchProgress),
) -> Result<(f64, Arc<SourceStats>, crate::telemetry::Latency), KafkaBenchError> {
    let stats = Arc::new(SourceStats::default());
    let stop = AtomicBool::new(false);
    let sub = SubscriptionConfig {
        subscriber: subscriber.into(),
        topics: vec![topic.into()],
        group: Some(format!("dedupd-bench-{subscriber}")),
        changelog,
    };
    std::thread::scope(|scope| {
        let worker = {
            let (ledger, stats, stop, sub) = (ledger.clone(), stats.clone(), &stop, &sub);
            scope.spawn(move || {
                run_subscription(
                    ledger,
                    kafka,
                    sub,
                    stop,
                    stats,
                    &RunOptions {
                        record_latency: true,
                    },
                )
            })
        };
        // Traffic starts once the group has assigned the partitions, so the group join
        // does not count as latency.
        let feeder = {
            let (stats, stop) = (&stats, &stop);
            let brokers = kafka.brokers.clone();
            scope.spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                while stats.assigned_partitions.load(Ordering::Relaxed) == 0 {
                    if Instant::now() > deadline {
                        return Err(KafkaBenchError::NoPartitions);
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                produce(&brokers, topic, spec, rate, &stats.released, stop)
            })
        };
        let mut first: Option<Instant> = None;
        let mut last = Instant::now();
        let deadline = Instant::now() + Duration::from_secs(1800);
        let mut outcome = Ok(());
        let (mut last_released, mut last_change) = (0, Instant::now());
        loop {
            let released = stats.released.load(Ordering::Relaxed);
            if released != last_released {
                (last_released, last_change) = (released, Instant::now());
            } else if last_change.elapsed() > Duration::from_secs(60) {
                outcome = Err(KafkaBenchError::NoProgress {
                    stored: released,
                    total,
                });
                break;
            }
            if first.is_none() && stats.received.load(Ordering::Relaxed) > 0 {
                first = Some(Instant::now());
            }
            if released >= total {
                break;
            }
            if worker.is_finished() || Instant::now() > deadline {
                outcome = Err(KafkaBenchError::Stalled {
                    stored: released,
                    total,
                });
                break;
            }
            if last.elapsed() >= Duration::from_millis(500) {
                last = Instant::now();
                progress(BenchProgress {
                    phase,
                    done: released,
                    total,
                    elapsed: first.map(|f| f.elapsed()).unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let secs = first.map(|f| f.elapsed().as_secs_f64()).unwrap_or(0.0);
        stop.store(true, Ordering::Relaxed);
        let latency = worker
            .join()
            .map_err(|_| KafkaBenchError::Panicked("Kafka source"))??;
        outcome?;
        feeder
            .join()
            .unwrap_or_else(|_| Err(KafkaBenchError::Panicked("producer")))?;
        Ok((secs, stats.clone(), latency.unwrap_or_default()))
    })
}

#[derive(Debug, Default)]
struct RestorePhase {
    takeover_changes: u64,
    takeover_s: f64,
    changes: u64,
    secs: f64,
    skipped: Option<String>,
}

/// Replays the engine phase's changelog into an empty data directory: partition 0 alone
/// (a member taking it over), then the others; then checks that the restored ledger holds
/// one claim per processed message, each equal to the engine's.
fn restore_phase(
    engine: &Ledger,
    config: &Config,
    kafka: &KafkaConfig,
    dir: &std::path::Path,
    topic: &str,
    partitions: i32,
    processed: u64,
) -> Result<RestorePhase, KafkaBenchError> {
    // The mock broker keeps only the newest 5 MB of a partition: a changelog it trimmed
    // cannot be restored whole, and a partial restore would measure less than it claims.
    let probe: rdkafka::consumer::BaseConsumer = super::client_config(kafka)
        .create()
        .map_err(KafkaBenchError::Client)?;
    let mut dropped = 0;
    for p in 0..partitions {
        let (low, _) = probe
            .fetch_watermarks(topic, p, Duration::from_secs(30))
            .map_err(KafkaBenchError::Client)?;
        dropped += low;
    }
    if dropped > 0 {
        return Ok(RestorePhase {
            skipped: Some(format!(
                "the broker dropped the first {dropped} changes of {topic} (the mock broker keeps the newest 5 MB of a partition): restore not measured; use more --partitions, fewer --messages, or --brokers"
            )),
            ..RestorePhase::default()
        });
    }
    let fresh = tempfile::Builder::new()
        .prefix("dedupd-kafka-bench-restore-")
        .tempdir_in(dir)
        .map_err(KafkaBenchError::DataDir)?;
    let ledger = Ledger::open(fresh.path(), config, Arc::new(SystemClock))?;
    let sub = ledger.subscriber("bench")?;
    let first = super::changelog::restore(&ledger, &sub, kafka, topic, &[0])?;
    let rest: Vec<i32> = (1..partitions).collect();
    let others = super::changelog::restore(&ledger, &sub, kafka, topic, &rest)?;
    let changes = first.changes + others.changes;
    let claims_of = |l: &Ledger| -> Result<u64, KafkaBenchError> {
        let r = l.report()?;
        Ok(r.subscribers
            .iter()
            .filter(|s| s.subscriber == "bench")
            .map(|s| s.claims)
            .sum())
    };
    let (restored, original) = (claims_of(&ledger)?, claims_of(engine)?);
    if changes != processed || restored != original {
        return Err(KafkaBenchError::RestoreCheck {
            changes,
            processed,
            restored,
            original,
        });
    }
    ledger.close()?;
    Ok(RestorePhase {
        takeover_changes: first.changes,
        takeover_s: first.elapsed.as_secs_f64(),
        changes,
        secs: (first.elapsed + others.elapsed).as_secs_f64(),
        skipped: None,
    })
}

/// Runs the whole benchmark, after [`KafkaBenchParams::validate`] (its refusal comes as
/// [`KafkaError::Config`]).
pub fn run(
    params: &KafkaBenchParams,
    progress: &mut dyn FnMut(BenchProgress),
) -> Result<KafkaBenchReport, KafkaBenchError> {
    params.validate()?;
    let Cluster {
        _broker,
        brokers,
        base_topic,
        topic,
        live_topic,
        changelog_prefix,
    } = Cluster::start(params)?;
    let spec = TrafficSpec {
        seed: params.seed,
        messages: params.messages,
        dup_rate: params.dup_rate,
        mismatch_rate: 0.0,
        subscribers: 1,
        random_order_ids: false,
        orders: None,
    };
    let baseline_s = baseline(&brokers, &base_topic, spec, progress)?;

    let dir = tempfile::Builder::new()
        .prefix("dedupd-kafka-bench-")
        .tempdir_in(&params.dir)
        .map_err(KafkaBenchError::DataDir)?;
    let config = engine_config(params);
    let ledger = Arc::new(Ledger::open(dir.path(), &config, Arc::new(SystemClock))?);
    crate::pipeline::install_handlers(&ledger, &config)
        .map_err(|e| KafkaBenchError::Handler(Box::new(e)))?;
    let kafka = kafka_config(params, &brokers, &changelog_prefix);
    let (engine_s, stats, backlog) = engine(
        &ledger,
        &kafka,
        "bench",
        &topic,
        params.messages,
        "engine",
        spec,
        None,
        params.changelog,
        progress,
    )?;
    let engine_rate = params.messages as f64 / engine_s.max(1e-9);

    let (mut live_rate, mut live) = (0.0, crate::telemetry::Latency::default());
    if params.live_messages > 0 {
        live_rate = (engine_rate * 0.5).max(1.0);
        let live_spec = TrafficSpec {
            seed: params.seed ^ 0x5eed,
            messages: params.live_messages,
            ..spec
        };
        let (_, _, lat) = engine(
            &ledger,
            &kafka,
            "bench-live",
            &live_topic,
            params.live_messages,
            "live",
            live_spec,
            Some(live_rate),
            params.changelog,
            progress,
        )?;
        live = lat;
    }
    let processed = stats.processed.load(Ordering::Relaxed);
    let restore = match (params.changelog, params.ttl) {
        (true, Some(_)) => RestorePhase {
            skipped: Some(
                "--ttl expires the claims during the run, so a restore has none to check".into(),
            ),
            ..RestorePhase::default()
        },
        (true, None) => restore_phase(
            &ledger,
            &config,
            &kafka,
            &params.dir,
            &super::changelog::topic_name(&changelog_prefix, "bench"),
            params.partitions,
            processed,
        )?,
        (false, _) => RestorePhase::default(),
    };
    let baseline_rate = params.messages as f64 / baseline_s.max(1e-9);
    let report = KafkaBenchReport {
        params: params.clone(),
        baseline_msgs_per_sec: baseline_rate,
        baseline_s,
        engine_msgs_per_sec: engine_rate,
        engine_s,
        ratio: engine_rate / baseline_rate.max(1e-9),
        processed,
        duplicate: stats.duplicate.load(Ordering::Relaxed),
        quarantined: stats.quarantined.load(Ordering::Relaxed),
        dead_lettered: stats.dead_lettered.load(Ordering::Relaxed),
        backlog_p99_ms: backlog.quantile_ms(0.99),
        live_rate,
        live_p50_ms: live.quantile_ms(0.5),
        live_p99_ms: live.quantile_ms(0.99),
        live_max_ms: live.max_ms(),
        takeover_changes: restore.takeover_changes,
        takeover_s: restore.takeover_s,
        restore_changes: restore.changes,
        restore_s: restore.secs,
        restore_changes_per_sec: restore.changes as f64 / restore.secs.max(1e-9),
        restore_skipped: restore.skipped,
        changelog_tombstones: stats.changelog_tombstones.load(Ordering::Relaxed),
        changelog_snapshots: stats.changelog_snapshots.load(Ordering::Relaxed),
    };
    match Arc::try_unwrap(ledger) {
        Ok(l) => l.close()?,
        Err(_) => return Err(KafkaBenchError::LedgerInUse),
    }
    Ok(report)
}

/// The cluster of a run (the mock one unless `--brokers`) and its topics, named after
/// the process and the seed.
struct Cluster {
    /// The mock cluster, kept running until the run ends.
    _broker: Option<DevBroker>,
    brokers: String,
    base_topic: String,
    topic: String,
    live_topic: String,
    changelog_prefix: String,
}

impl Cluster {
    fn start(params: &KafkaBenchParams) -> Result<Cluster, KafkaBenchError> {
        let broker = match &params.brokers {
            Some(_) => None,
            None => Some(DevBroker::start(1)?),
        };
        let brokers = match (&params.brokers, &broker) {
            (Some(b), _) => b.clone(),
            (None, Some(d)) => d.bootstrap_servers(),
            (None, None) => return Err(KafkaBenchError::NoBroker),
        };
        let run_id = format!("{}-{}", std::process::id(), params.seed);
        let c = Cluster {
            brokers,
            base_topic: format!("dedupd-bench-base-{run_id}"),
            topic: format!("dedupd-bench-{run_id}"),
            live_topic: format!("dedupd-bench-live-{run_id}"),
            changelog_prefix: format!("dedupd-bench-{run_id}"),
            _broker: broker,
        };
        if let Some(d) = &c._broker {
            for t in [&c.base_topic, &c.topic, &c.live_topic] {
                d.create_topic(t, params.partitions)?;
            }
            if params.changelog {
                // The mock cluster has no CreateTopics; on a real one dedupd creates them.
                for sub in ["bench", "bench-live"] {
                    let t = super::changelog::topic_name(&c.changelog_prefix, sub);
                    d.create_topic(&t, params.partitions)?;
                }
            }
        }
        Ok(c)
    }
}

/// The engine's config: the subscribers `bench` and `bench-live`, keyed by the
/// `message-id` header, state per order.
fn engine_config(params: &KafkaBenchParams) -> Config {
    let mut config = Config::default();
    config.ledger.shards = params.shards.and_then(NonZeroUsize::new);
    for name in ["bench", "bench-live"] {
        config.subscribers.push(SubscriberConfig {
            name: name.into(),
            key: Some(KeySource::Header {
                name: "message-id".into(),
            }),
            // One writer per order: the handler's per-order state stays consistent.
            partition_key: Some(PartitionSource::EnvelopeKey),
            handler: params.handler.clone(),
            ttl: params.ttl,
            ..Default::default()
        });
    }
    config
}

/// The `[kafka]` section the engine runs with.
fn kafka_config(params: &KafkaBenchParams, brokers: &str, changelog_prefix: &str) -> KafkaConfig {
    let mut kafka = KafkaConfig::new(brokers.to_string());
    kafka.session_timeout = Duration::from_secs(6);
    kafka
        .options
        .insert("fetch.wait.max.ms".into(), FETCH_WAIT_MS.into());
    kafka.changelog.prefix = changelog_prefix.to_string();
    if params.ttl.is_some() {
        kafka.changelog.compaction_interval = Duration::from_secs(1);
        kafka.changelog.expiry_grace = Duration::ZERO;
    }
    kafka
}
