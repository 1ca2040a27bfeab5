//! `dedupd bench`: in-process load against the real engine (real redb files, durable
//! commits, in-order acks), and in the same run a naive redb baseline.
//!
//! Per message the driver formats an id and a ~90-byte JSON payload, hashes both (xxh3),
//! routes to a shard, and waits for the in-order durable outcome. JSON *parsing* is not in
//! this loop (pipe mode pays it); everything after the envelope is.
//!
//! Ack latency is measured from the moment a message is handed to the engine (or, with a
//! paced load, `--rate`, from the moment it was due) until its outcome is released in
//! source order. A window bounds the messages in flight, as a broker consumer's fetch
//! buffer would.
//!
//! Beside it here: `soak` (hours of TTL churn, checked) and `adversarial` (subscribers that
//! misbehave). Comparisons with other stores (PostgreSQL, Redis, SQLite) and the plots
//! live in the workspace's `dedupd-bench` crate, so the product builds without their
//! clients.
//!
//! Where things are:
//!
//! - `bench.rs`: what a run takes and reports ([`BenchParams`], [`BenchReport`]), the
//!   run ([`run()`]): the engine part, what the ledger measured, the naive baseline
//!   ([`run_naive`]);
//! - `params.rs`: the checks every bench's params run before anything starts
//!   ([`ParamError`]), the broker benches' included;
//! - `drive.rs`: the engine part's two threads: the generator that submits (within the
//!   window, paced with `--rate`) and the acker that releases outcomes in order and
//!   measures latency, memory and the series;
//! - `report.rs`: the live line and the printed report;
//! - `soak.rs`: hours of TTL churn, checked ([`run_soak`]);
//! - `adversarial.rs`: subscribers that misbehave ([`run_adversarial`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod adversarial;
mod drive;
pub mod params;
mod report;
pub mod soak;

pub use adversarial::run_adversarial;

pub use adversarial::AdversarialParams;

pub use adversarial::AdversarialReport;
pub use params::ParamError;
pub use soak::{run_soak, SoakParams, SoakReport, SoakSample};

use crossbeam_channel::unbounded;
use serde::Serialize;

use crate::clock::SystemClock;
use crate::config::{Config, PartitionSource};
use crate::envelope::{fingerprint, key_hash};
use crate::ledger::{Done, Job, Ledger, LedgerError};
use crate::source::generator::{Event, Expect, Traffic, TrafficSpec};
use crate::telemetry::{rss_bytes, Latency};
use drive::{drive, spawn_acker, AckerResult, Driven, Live};

/// Parameters of one run.
#[derive(Debug, Clone, Serialize)]
pub struct BenchParams {
    pub messages: u64,
    pub dup_rate: f64,
    pub mismatch_rate: f64,
    pub subscribers: u32,
    pub seed: u64,
    /// Most messages in flight (handed to the engine, outcome not yet released).
    pub window: u64,
    /// Messages for the naive baseline (0: skip it).
    pub naive_messages: u64,
    /// Where to put the data directory (a fresh temporary directory inside it).
    pub dir: PathBuf,
    /// Keep the data directory afterwards.
    pub keep: bool,
    /// Run this handler component for every new message.
    pub handler: Option<PathBuf>,
    /// With a handler: the subscribers' `partition_key` JSON pointer, as the docs
    /// recommend for per-order state (`/order_id`); `None`: no partition key, so each
    /// subscriber's handler runs on one shard. Routing goes through `Ledger::place`, as
    /// for every source.
    pub partition_pointer: Option<String>,
    /// Random order ids instead of numbers in sequence (see `TrafficSpec`).
    pub random_order_ids: bool,
    /// New events spread over this many orders (see `TrafficSpec::orders`).
    pub orders: Option<u64>,
    /// Released messages between two points of [`BenchReport::series`].
    pub series_step: u64,
    /// Offered load in messages per second (`None`: as fast as the window allows). Each
    /// message is due at `start + seq / rate`, and its latency counts from then, so a run
    /// that falls behind counts the wait too (no coordinated omission).
    pub rate: Option<u64>,
    #[serde(skip)]
    pub config: Config,
}

impl BenchParams {
    /// Refuses parameters the run cannot use: the rates are fractions whose sum is below 1,
    /// and `messages`, `series_step`, `orders` and `rate` (when set) are at least 1.
    /// [`run()`] calls it first.
    pub fn validate(&self) -> Result<(), ParamError> {
        params::fraction("dup_rate", self.dup_rate)?;
        params::fraction("mismatch_rate", self.mismatch_rate)?;
        let sum = self.dup_rate + self.mismatch_rate;
        params::require(sum < 1.0, "dup_rate + mismatch_rate", "less than 1", sum)?;
        params::at_least_one("messages", self.messages)?;
        params::at_least_one("series_step", self.series_step)?;
        params::at_least_one_if_set("orders", self.orders)?;
        params::at_least_one_if_set("rate", self.rate)
    }
}

/// Everything a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub params: BenchParams,
    pub(crate) data_dir: PathBuf,
    pub(crate) shards: usize,
    pub(crate) elapsed_s: f64,
    pub msgs_per_sec: f64,
    pub processed: u64,
    pub duplicates: u64,
    pub quarantined: u64,
    /// Outcomes matched what the generator knows each message must get.
    pub verified: bool,
    pub p50_ack_ms: f64,
    pub p99_ack_ms: f64,
    pub(crate) max_ack_ms: f64,
    pub stored_keys: u64,
    /// Resident memory of the empty engine: opened with the same settings, subscribers
    /// and handler, before the first message.
    pub(crate) rss_base_bytes: u64,
    /// Resident memory after the last outcome, before the engine closes.
    pub(crate) rss_end_bytes: u64,
    pub(crate) rss_max_bytes: u64,
    /// `(rss_end_bytes - rss_base_bytes) / stored_keys` (0 when the end is below the
    /// base): resident bytes the run added per stored key, allocator slack included.
    pub rss_bytes_per_key: f64,
    /// Resident memory right after `rss_end_bytes`, once the allocator returned the freed
    /// memory it keeps for reuse (mimalloc's purge delay, 10 s; see `main.rs`), and the
    /// same per stored key: the live part of `rss_bytes_per_key`.
    pub(crate) rss_collected_bytes: u64,
    pub(crate) rss_collected_bytes_per_key: f64,
    /// The engine's own accounting of its claim indexes (active, sealing and the spare kept
    /// ready for the next generation; bucket arrays as allocated) per stored key.
    pub(crate) index_bytes_per_key: f64,
    /// Longest single durable commit.
    pub(crate) max_commit_ms: f64,
    /// The process's CPU time (user and system) over the engine run, per message.
    pub(crate) cpu_us_per_msg: f64,
    /// Seconds the process's threads spent on a CPU, and runnable but waiting for one,
    /// over the engine run (`telemetry::sched`; 0 off Linux). A thread waits when every
    /// core is held, by the process's other threads (more runnable threads than cores) or
    /// by other work on the machine: the part above what a quiet machine gives is how busy
    /// it was.
    pub(crate) threads_running_s: f64,
    pub(crate) threads_waiting_s: f64,
    /// Filters of sealed generations per stored key (the part that grows with keys).
    pub(crate) filter_bytes_per_key: f64,
    /// Length of the data directory's files.
    pub(crate) disk_bytes: u64,
    /// Data directory bytes per stored claim (with a handler: claim and its state).
    pub(crate) disk_bytes_per_key: f64,
    /// Bytes the data directory's files take on the disk (allocated blocks, as `du`
    /// counts): redb grows a file ahead of use, and the part not yet written is a hole.
    pub(crate) disk_allocated_bytes: u64,
    pub disk_allocated_bytes_per_key: f64,
    pub(crate) batches: u64,
    pub(crate) commits: u64,
    pub(crate) mean_batch: f64,
    pub(crate) max_batch_ms_plain: f64,
    pub(crate) max_batch_ms_with_maintenance: f64,
    /// The longest batch of either kind.
    pub(crate) max_batch_ms: f64,
    pub(crate) seals: u64,
    pub(crate) merges: u64,
    pub(crate) filter_probes: u64,
    pub(crate) filter_false_positive_rate: f64,
    /// New keys of entity-placed subscribers asked of the other shard (a round trip), and
    /// those every other shard's published presence ruled out (`ledger/presence.rs`).
    pub(crate) probed_keys: u64,
    pub(crate) unprobed_keys: u64,
    /// Handler state entries at the end (labels, with `shipping-label`).
    pub(crate) state_entries: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) naive_messages: u64,
    pub(crate) naive_batch: u64,
    pub(crate) naive_msgs_per_sec: f64,
    pub(crate) engine_over_naive: f64,
    /// Throughput over each `series_step` released messages, in order: whether the rate
    /// holds as the stored claims grow.
    pub series: Vec<SeriesPoint>,
}

/// Throughput of one step of the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SeriesPoint {
    /// Messages released when the step ended.
    pub messages: u64,
    /// Messages per second within the step.
    pub msgs_per_sec: f64,
    /// Released as processed so far (new claims written; with a TTL some have expired).
    pub processed: u64,
    /// The process's resident memory when the step ended, and the data directory's
    /// allocated blocks then (as `du` counts), so growth per key is visible in one run.
    pub rss_bytes: u64,
    pub disk_allocated_bytes: u64,
}

/// Progress of a running benchmark, for the live line.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub phase: &'static str,
    pub done: u64,
    pub total: u64,
    pub elapsed: Duration,
    pub p99_ms: f64,
}

/// Errors of a benchmark run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("cannot create the benchmark directory in {0}: {1}")]
    Dir(PathBuf, std::io::Error),
    #[error("naive baseline failed: {0}")]
    Naive(String),
    #[error(transparent)]
    Handler(#[from] crate::handler::HandlerError),
    #[error(transparent)]
    Params(#[from] ParamError),
}

/// Resident bytes per key added over a base; never negative (an end below the base, when
/// the allocator returned memory, counts as nothing added).
pub(crate) fn bytes_per_key(end: u64, base: u64, keys: u64) -> f64 {
    end.saturating_sub(base) as f64 / keys.max(1) as f64
}

/// The config a run uses: the given one, with the documented partition key for handler
/// runs when it configures none.
pub(crate) fn bench_config(params: &BenchParams) -> Config {
    let mut config = params.config.clone();
    // Configured, as a deployment with many subscribers would have them (unconfigured
    // ones are capped by `ledger.max_implicit_subscribers`).
    for i in 0..params.subscribers.max(1) {
        let name = format!("bench-{i}");
        if !config.subscribers.iter().any(|s| s.name == name) {
            config.subscribers.push(crate::config::SubscriberConfig {
                name,
                ..Default::default()
            });
        }
    }
    if let (Some(_), Some(pointer)) = (&params.handler, &params.partition_pointer) {
        if config.defaults.partition_key == PartitionSource::IdempotencyKey {
            config.defaults.partition_key = PartitionSource::JsonPointer {
                pointer: pointer.clone(),
            };
        }
    }
    config
}

/// Routes a generated event as a source would: the entity (when the subscriber configures
/// a partition key) comes from its JSON payload, then `Ledger::place`.
pub(crate) fn place_event(
    ledger: &Ledger,
    sub: &crate::ledger::Subscriber,
    settings: &crate::config::SubscriberSettings,
    job: &mut Job,
) -> Result<usize, LedgerError> {
    let entity = if settings.partition_key == PartitionSource::IdempotencyKey {
        None
    } else {
        let env = crate::envelope::Envelope {
            payload: crate::envelope::payload_json(&job.payload, settings),
            ..Default::default()
        };
        crate::envelope::derive_entity(&env, settings)
            .map_err(|e| LedgerError::Invalid(format!("generated event: {e}")))?
            .map(std::borrow::Cow::into_owned)
    };
    Ok(ledger.place(sub, job, entity))
}

/// Runs the engine part and, unless disabled, the naive baseline, after
/// [`BenchParams::validate`].
pub fn run(
    params: &BenchParams,
    mut progress: impl FnMut(Progress),
) -> Result<BenchReport, BenchError> {
    params.validate()?;
    let tmp = tempfile::Builder::new()
        .prefix(".dedupd-bench-")
        .tempdir_in(&params.dir)
        .map_err(|e| BenchError::Dir(params.dir.clone(), e))?;
    let data_dir = tmp.path().join("engine");
    let ledger = Ledger::open(&data_dir, &bench_config(params), Arc::new(SystemClock))?;
    let subs = bench_subscribers(&ledger, params)?;
    let rss_base = rss_bytes();
    let cpu_base = crate::telemetry::process::read().map(|p| p.cpu_seconds);
    let sched_base = crate::telemetry::sched::threads();
    let spec = TrafficSpec {
        seed: params.seed,
        messages: params.messages,
        dup_rate: params.dup_rate,
        mismatch_rate: params.mismatch_rate,
        subscribers: params.subscribers.max(1),
        random_order_ids: params.random_order_ids,
        orders: params.orders,
    };
    let live = Arc::new(Live::new(params.window.max(1), params.rate));
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    let acker = spawn_acker(
        live.clone(),
        ack_rx,
        std::thread::current(),
        params.series_step.max(1),
        data_dir.clone(),
    )?;
    let driven = drive(&ledger, &subs, spec, &live, ack_tx, &mut progress)?;
    let elapsed = live.start.elapsed();
    let rss_end = rss_bytes();
    let cpu_s = cpu_base
        .zip(crate::telemetry::process::read())
        .map_or(0.0, |(base, end)| end.cpu_seconds - base);
    let sched = sched_base
        .zip(crate::telemetry::sched::threads())
        .map(|(base, end)| end.since(&base))
        .unwrap_or_default();
    // What of it is freed memory the allocator keeps for reuse (its purge delay).
    crate::telemetry::return_freed_memory();
    let rss_collected = rss_bytes();
    let measured = Measured::take(&ledger, &subs)?;
    ledger.close()?;
    let acked = acker
        .join()
        .map_err(|_| BenchError::Naive("acker panicked".into()))?;
    let rss = (rss_base, rss_end, rss_collected);
    let mut report = assemble(params, &driven, &acked, &measured, elapsed, rss);
    report.data_dir = data_dir;
    report.cpu_us_per_msg = cpu_s * 1e6 / driven.messages.max(1) as f64;
    report.threads_running_s = sched.running_ns as f64 / 1e9;
    report.threads_waiting_s = sched.waiting_ns as f64 / 1e9;
    report.disk_bytes = crate::ledger::dir_bytes(&report.data_dir);
    report.disk_bytes_per_key = report.disk_bytes as f64 / report.stored_keys.max(1) as f64;
    report.disk_allocated_bytes = crate::ledger::dir_allocated_bytes(&report.data_dir);
    report.disk_allocated_bytes_per_key =
        report.disk_allocated_bytes as f64 / report.stored_keys.max(1) as f64;
    report.naive_batch = report.mean_batch.round().max(1.0) as u64;
    if params.naive_messages > 0 {
        let n = params.naive_messages;
        report.naive_messages = n;
        report.naive_msgs_per_sec = run_naive(
            &tmp.path().join("naive.redb"),
            TrafficSpec {
                messages: n,
                ..spec
            },
            report.naive_batch,
            params.config.ledger.cache_mib.get() * report.shards,
            0,
            &mut progress,
        )?
        .msgs_per_sec;
        report.engine_over_naive = report.msgs_per_sec / report.naive_msgs_per_sec;
    }
    if params.keep {
        let _ = tmp.keep();
    }
    Ok(report)
}

/// The run's subscribers (`bench-0`, ...), each with the handler when one is given.
fn bench_subscribers(
    ledger: &Ledger,
    params: &BenchParams,
) -> Result<Vec<Arc<crate::ledger::Subscriber>>, BenchError> {
    let subs: Vec<_> = (0..params.subscribers.max(1))
        .map(|i| ledger.subscriber(&format!("bench-{i}")))
        .collect::<Result<_, _>>()?;
    if let Some(path) = &params.handler {
        let factory = crate::handler::load_factory(path, crate::handler::Limits::default())?;
        for s in &subs {
            ledger.set_handler(&s.name, Some(factory.clone()))?;
        }
    }
    Ok(subs)
}

/// What the ledger reports at the end of the engine run.
struct Measured {
    report: crate::ledger::LedgerReport,
    state_entries: u64,
    metrics: Vec<crate::ledger::ShardMetrics>,
    filter_probes: u64,
    filter_false_positives: u64,
}

impl Measured {
    fn take(
        ledger: &Ledger,
        subs: &[Arc<crate::ledger::Subscriber>],
    ) -> Result<Measured, BenchError> {
        let mut state_entries = 0;
        for s in subs {
            state_entries += ledger.state_len(&s.name)?;
        }
        let counters = ledger.subscribers();
        let sum = |f: fn(&crate::ledger::Subscriber) -> &AtomicU64| -> u64 {
            counters.iter().map(|c| f(c).load(Ordering::Relaxed)).sum()
        };
        Ok(Measured {
            report: ledger.report()?,
            state_entries,
            metrics: ledger.metrics(),
            filter_probes: sum(|c| &c.counters.filter_probes),
            filter_false_positives: sum(|c| &c.counters.filter_false_positives),
        })
    }
}

/// The engine part of the report (no naive baseline yet, no data directory figures).
fn assemble(
    params: &BenchParams,
    driven: &Driven,
    acked: &AckerResult,
    measured: &Measured,
    elapsed: Duration,
    (rss_base, rss_end, rss_collected): (u64, u64, u64),
) -> BenchReport {
    let m = &measured.metrics;
    let max_ms = |f: fn(&crate::ledger::ShardMetrics) -> u64| {
        m.iter().map(f).max().unwrap_or(0) as f64 / 1000.0
    };
    let subscribers = &measured.report.subscribers;
    let stored_keys: u64 = subscribers.iter().map(|s| s.claims).sum();
    let filter_bytes: u64 = subscribers.iter().map(|s| s.filter_bytes).sum();
    let index_bytes: u64 = subscribers.iter().map(|s| s.index_bytes).sum::<u64>()
        + measured
            .metrics
            .iter()
            .map(|m| m.spare_index_bytes)
            .sum::<u64>();
    let batches: u64 = m.iter().map(|m| m.batches).sum();
    let seq = driven.messages;
    let mean_batch = seq as f64 / batches.max(1) as f64;
    let counts = &acked.counts;
    let verified = counts.matches(&driven.expected);
    let probes = measured.filter_probes;
    BenchReport {
        params: params.clone(),
        data_dir: PathBuf::new(),
        shards: measured.report.shards,
        elapsed_s: elapsed.as_secs_f64(),
        msgs_per_sec: seq as f64 / elapsed.as_secs_f64(),
        processed: counts.processed,
        duplicates: counts.duplicates,
        quarantined: counts.quarantined,
        verified,
        p50_ack_ms: acked.latency.quantile_ms(0.5),
        p99_ack_ms: acked.latency.quantile_ms(0.99),
        max_ack_ms: acked.latency.max_ms(),
        stored_keys,
        rss_base_bytes: rss_base,
        rss_end_bytes: rss_end,
        rss_max_bytes: acked.rss_max.max(rss_end),
        rss_collected_bytes: rss_collected,
        rss_collected_bytes_per_key: bytes_per_key(rss_collected, rss_base, stored_keys),
        max_commit_ms: max_ms(|m| m.max_commit_us),
        cpu_us_per_msg: 0.0,
        threads_running_s: 0.0,
        threads_waiting_s: 0.0,
        rss_bytes_per_key: bytes_per_key(rss_end, rss_base, stored_keys),
        index_bytes_per_key: index_bytes as f64 / stored_keys.max(1) as f64,
        filter_bytes_per_key: filter_bytes as f64 / stored_keys.max(1) as f64,
        disk_bytes: 0,
        disk_bytes_per_key: 0.0,
        disk_allocated_bytes: 0,
        disk_allocated_bytes_per_key: 0.0,
        batches,
        commits: m.iter().map(|m| m.commits).sum(),
        mean_batch,
        max_batch_ms_plain: max_ms(|m| m.max_batch_us_plain),
        max_batch_ms_with_maintenance: max_ms(|m| m.max_batch_us_maintenance),
        max_batch_ms: max_ms(|m| m.max_batch_us_plain.max(m.max_batch_us_maintenance)),
        seals: m.iter().map(|m| m.seals).sum(),
        merges: m.iter().map(|m| m.merges).sum(),
        filter_probes: probes,
        filter_false_positive_rate: measured.filter_false_positives as f64 / probes.max(1) as f64,
        probed_keys: m.iter().map(|m| m.probed_keys).sum(),
        unprobed_keys: m.iter().map(|m| m.unprobed_keys).sum(),
        state_entries: measured.state_entries,
        dead_lettered: counts.dead_lettered,
        naive_messages: 0,
        naive_batch: 0,
        naive_msgs_per_sec: f64::NAN,
        engine_over_naive: f64::NAN,
        series: acked.series.clone(),
    }
}

/// What one naive baseline run measured.
#[derive(Debug, Clone, Copy)]
pub struct NaiveRun {
    pub msgs_per_sec: f64,
    /// Messages whose key was new (inserted), and the rest.
    pub processed: u64,
    pub duplicates: u64,
    /// What the generator says the traffic must give: new and repeated ids.
    pub expected: [u64; 2],
    /// Per durable batch commit.
    pub p50_batch_ms: f64,
    pub p99_batch_ms: f64,
    /// Keys in the table at the end, counted (preloaded ones included).
    pub stored_keys: u64,
}

/// The baseline a careful user would write first: one redb table keyed by the 128-bit id
/// hash, one durable commit per batch of the engine's mean batch size, get-then-insert per
/// message, random keys. Same traffic, same hashing, same cache budget.
pub fn run_naive(
    path: &Path,
    spec: TrafficSpec,
    batch: u64,
    cache_mib: usize,
    stored: u64,
    progress: &mut impl FnMut(Progress),
) -> Result<NaiveRun, BenchError> {
    let e = |x: &dyn std::fmt::Display| BenchError::Naive(x.to_string());
    let naive = crate::ledger::NaiveBaseline::create(path, cache_mib).map_err(|x| e(&x))?;
    if stored > 0 {
        naive.preload(stored, spec.seed).map_err(|x| e(&x))?;
    }
    let mut traffic = Traffic::new(spec);
    let mut ev = Event::default();
    let start = Instant::now();
    let mut last = Instant::now();
    let mut done = 0u64;
    let mut processed = 0u64;
    let mut expected = [0u64; 2];
    let mut latency = Latency::default();
    let mut pending: Vec<(u128, u64)> = Vec::with_capacity(batch as usize);
    let mut more = true;
    while more {
        pending.clear();
        while (pending.len() as u64) < batch {
            if !traffic.next_into(&mut ev) {
                more = false;
                break;
            }
            expected[usize::from(ev.expect != Some(Expect::New))] += 1;
            pending.push((key_hash(ev.id.as_bytes()), fingerprint(&ev.payload)));
        }
        if pending.is_empty() {
            break;
        }
        let t = Instant::now();
        processed += naive.claim_batch(&pending).map_err(|x| e(&x))?;
        latency.record_us(t.elapsed().as_micros() as u64);
        done += pending.len() as u64;
        if last.elapsed() >= Duration::from_secs(1) {
            last = Instant::now();
            progress(Progress {
                phase: "naive",
                done,
                total: spec.messages,
                elapsed: start.elapsed(),
                p99_ms: f64::NAN,
            });
        }
    }
    Ok(NaiveRun {
        msgs_per_sec: done as f64 / start.elapsed().as_secs_f64(),
        processed,
        duplicates: done - processed,
        expected,
        p50_batch_ms: latency.quantile_ms(0.5),
        p99_batch_ms: latency.quantile_ms(0.99),
        stored_keys: naive.stored_keys().map_err(|x| e(&x))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ledger_error_is_told_once_in_an_error_chain() {
        for e in [
            anyhow::Error::from(BenchError::from(LedgerError::Invalid(
                "disk on fire".into(),
            ))),
            anyhow::Error::from(crate::source::stdin::PipeError::from(LedgerError::Invalid(
                "disk on fire".into(),
            ))),
            anyhow::Error::from(crate::admin::UploadError::from(LedgerError::Invalid(
                "disk on fire".into(),
            ))),
        ] {
            assert_eq!(format!("{e:#}").matches("disk on fire").count(), 1, "{e:#}");
        }
    }

    #[test]
    fn many_subscribers_are_configured_not_implicit() {
        let tmp = tempfile::tempdir().unwrap();
        let params = BenchParams {
            messages: 1_000,
            subscribers: 100,
            series_step: 1_000_000,
            rate: None,
            naive_messages: 0,
            dir: tmp.path().to_path_buf(),
            ..small_params()
        };
        assert!(params.subscribers as usize > params.config.ledger.max_implicit_subscribers);
        let r = run(&params, |_| {}).unwrap();
        assert!(r.verified);
    }

    fn small_params() -> BenchParams {
        BenchParams {
            messages: 20_000,
            dup_rate: 0.1,
            mismatch_rate: 0.01,
            subscribers: 2,
            seed: 7,
            window: 1_024,
            naive_messages: 500,
            dir: std::path::PathBuf::from("."),
            keep: false,
            handler: None,
            partition_pointer: None,
            random_order_ids: false,
            orders: None,
            series_step: 5_000,
            rate: None,
            config: Config::default(),
        }
    }

    /// `run` refuses what it cannot use before it creates anything, and says which
    /// parameter and which flag.
    #[test]
    fn run_refuses_bad_parameters_before_it_starts() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        for (params, said) in [
            (
                BenchParams {
                    dup_rate: 1.5,
                    ..small_params()
                },
                "dup_rate (--dup-rate) must be in [0, 1), got 1.5",
            ),
            (
                BenchParams {
                    dup_rate: 0.5,
                    mismatch_rate: 0.5,
                    ..small_params()
                },
                "dup_rate + mismatch_rate (--dup-rate + --mismatch-rate) must be less than 1, got 1",
            ),
            (
                BenchParams {
                    messages: 0,
                    ..small_params()
                },
                "messages (--messages) must be at least 1, got 0",
            ),
            (
                BenchParams {
                    orders: Some(0),
                    ..small_params()
                },
                "orders (--orders) must be at least 1, got 0",
            ),
        ] {
            let params = BenchParams {
                dir: dir.clone(),
                ..params
            };
            let e = run(&params, |_| {}).unwrap_err();
            assert_eq!(e.to_string(), said);
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    }

    #[test]
    fn bytes_per_key_is_never_negative() {
        assert_eq!(bytes_per_key(100, 200, 10), 0.0);
        assert_eq!(bytes_per_key(300, 100, 10), 20.0);
        assert_eq!(bytes_per_key(300, 100, 0), 200.0);
    }

    #[test]
    fn a_small_run_verifies_and_reports_its_series_and_per_key_figures() {
        let tmp = tempfile::tempdir().unwrap();
        let params = BenchParams {
            dir: tmp.path().to_path_buf(),
            ..small_params()
        };
        let r = run(&params, |_| {}).unwrap();
        assert!(r.verified);
        assert_eq!(r.processed + r.duplicates + r.quarantined, 20_000);
        // A point per 5,000 released messages (the watermark moves in batches, so a
        // point may land a little past its multiple).
        assert!((3..=4).contains(&r.series.len()), "{:?}", r.series);
        assert!(r.series.windows(2).all(|w| w[0].messages < w[1].messages));
        assert!(r
            .series
            .iter()
            .all(|p| p.msgs_per_sec.is_finite() && p.msgs_per_sec > 0.0));
        // Memory and disk are read at each point; processed grows with released messages.
        assert!(r.series.windows(2).all(|w| w[0].processed < w[1].processed));
        assert!(r
            .series
            .iter()
            .all(|p| p.processed <= p.messages && p.rss_bytes > 0 && p.disk_allocated_bytes > 0));
        let last = r.series.last().unwrap();
        assert!(last.processed <= r.processed && last.processed * 10 >= last.messages * 8);
        assert!(r.rss_bytes_per_key >= 0.0 && r.rss_base_bytes > 0);
        assert!(r.rss_collected_bytes > 0 && r.rss_collected_bytes_per_key >= 0.0);
        assert_eq!(r.stored_keys, r.processed);
        assert!(r.disk_bytes_per_key > 0.0);
        assert!(r.disk_allocated_bytes_per_key > 0.0);
        assert!(r.index_bytes_per_key > 0.0);
        assert!(r.max_batch_ms >= r.max_batch_ms_plain);
        assert!(r.naive_msgs_per_sec > 0.0);
        // 20,000 messages cost some CPU, and not more than a whole core-second each.
        assert!(
            r.cpu_us_per_msg > 0.0 && r.cpu_us_per_msg < 1e6,
            "{}",
            r.cpu_us_per_msg
        );
        #[cfg(target_os = "linux")]
        assert!(
            r.threads_running_s > 0.0 && r.threads_waiting_s >= 0.0,
            "{} {}",
            r.threads_running_s,
            r.threads_waiting_s
        );
    }
}
