//! `dedupd bench`: in-process load against the real engine (real redb files, durable
//! commits, in-order acks), and in the same run a naive redb baseline.
//!
//! Per message the driver formats an id and a ~90-byte JSON payload, hashes both (xxh3),
//! routes to a shard, and waits for the in-order durable outcome. JSON *parsing* is not in
//! this loop (pipe mode pays it); everything after the envelope is.
//!
//! Ack latency is measured from the moment a message is handed to the engine until its
//! outcome is released in source order. A window bounds the messages in flight, as a
//! broker consumer's fetch buffer would.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use serde::Serialize;

use crate::clock::SystemClock;
use crate::config::{Config, PartitionSource};
use crate::envelope::{fingerprint, key_hash};
use crate::ledger::{Done, Job, Ledger, LedgerError, Outcome};
use crate::pipeline::Sequencer;
use crate::source::generator::{Event, Expect, Traffic, TrafficSpec};
use crate::telemetry::{rss_bytes, Latency};

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
    #[serde(skip)]
    pub config: Config,
}

/// Everything a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub params: BenchParams,
    pub data_dir: PathBuf,
    pub shards: usize,
    pub elapsed_s: f64,
    pub msgs_per_sec: f64,
    pub processed: u64,
    pub duplicates: u64,
    pub quarantined: u64,
    /// Outcomes matched what the generator knows each message must get.
    pub verified: bool,
    pub p50_ack_ms: f64,
    pub p99_ack_ms: f64,
    pub max_ack_ms: f64,
    pub stored_keys: u64,
    /// Intercept of the RSS-vs-keys line: the fixed base.
    pub rss_base_bytes: u64,
    pub rss_end_bytes: u64,
    pub rss_max_bytes: u64,
    /// Slope of the least-squares line through RSS samples taken every 250 ms once two
    /// generations per shard exist: resident bytes added per stored key.
    pub rss_bytes_per_key: f64,
    /// Longest single durable commit.
    pub max_commit_ms: f64,
    /// Filters of sealed generations per stored key (the part that grows with keys).
    pub filter_bytes_per_key: f64,
    pub disk_bytes: u64,
    pub batches: u64,
    pub commits: u64,
    pub mean_batch: f64,
    pub max_batch_ms_plain: f64,
    pub max_batch_ms_with_maintenance: f64,
    pub seals: u64,
    pub merges: u64,
    pub filter_probes: u64,
    pub filter_false_positive_rate: f64,
    /// Handler state entries at the end (labels, with `shipping-label`).
    pub state_entries: u64,
    pub dead_lettered: u64,
    pub naive_messages: u64,
    pub naive_batch: u64,
    pub naive_msgs_per_sec: f64,
    pub engine_over_naive: f64,
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
    #[error("{0}")]
    Ledger(#[from] LedgerError),
    #[error("cannot create the benchmark directory in {0}: {1}")]
    Dir(PathBuf, std::io::Error),
    #[error("naive baseline failed: {0}")]
    Naive(String),
    #[error("{0}")]
    Handler(#[from] crate::handler::HandlerError),
}

struct AckerResult {
    latency: Latency,
    counts: [u64; 6],
    /// (claims processed, RSS) every quarter second.
    rss_samples: Vec<(u64, u64)>,
}

/// Least-squares line through `(keys, rss)` samples: (bytes per key, intercept).
pub fn rss_slope(samples: &[(u64, u64)]) -> Option<(f64, f64)> {
    if samples.len() < 4 {
        return None;
    }
    let n = samples.len() as f64;
    let mx = samples.iter().map(|s| s.0 as f64).sum::<f64>() / n;
    let my = samples.iter().map(|s| s.1 as f64).sum::<f64>() / n;
    let sxx: f64 = samples.iter().map(|s| (s.0 as f64 - mx).powi(2)).sum();
    let sxy: f64 = samples
        .iter()
        .map(|s| (s.0 as f64 - mx) * (s.1 as f64 - my))
        .sum();
    if sxx <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    Some((slope, my - slope * mx))
}

/// The config a run uses: the given one, with the documented partition key for handler
/// runs when it configures none.
pub fn bench_config(params: &BenchParams) -> Config {
    let mut config = params.config.clone();
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
pub fn place_event(
    ledger: &Ledger,
    sub: &crate::ledger::Subscriber,
    settings: &crate::config::SubscriberSettings,
    job: &mut Job,
) -> Result<usize, LedgerError> {
    let entity = if settings.partition_key == PartitionSource::IdempotencyKey {
        None
    } else {
        let env = crate::envelope::Envelope {
            payload: serde_json::from_slice(&job.payload).unwrap_or_default(),
            ..Default::default()
        };
        crate::envelope::derive_entity(&env, settings)
            .map_err(|e| LedgerError::Invalid(format!("generated event: {e}")))?
    };
    Ok(ledger.place(sub, job, entity))
}

/// Runs the engine part and, unless disabled, the naive baseline.
pub fn run(
    params: &BenchParams,
    mut progress: impl FnMut(Progress),
) -> Result<BenchReport, BenchError> {
    let tmp = tempfile::Builder::new()
        .prefix(".dedupd-bench-")
        .tempdir_in(&params.dir)
        .map_err(|e| BenchError::Dir(params.dir.clone(), e))?;
    let data_dir = tmp.path().join("engine");
    let config = bench_config(params);
    let ledger = Ledger::open(&data_dir, &config, Arc::new(SystemClock))?;
    let shards = ledger.shard_count();
    let subs: Vec<_> = (0..params.subscribers.max(1))
        .map(|i| ledger.subscriber(&format!("bench-{i}")))
        .collect::<Result<_, _>>()?;
    if let Some(path) = &params.handler {
        let factory = crate::handler::load_factory(path, crate::handler::Limits::default())?;
        for s in &subs {
            ledger.set_handler(&s.name, Some(factory.clone()))?;
        }
    }
    let settings: Vec<_> = subs.iter().map(|s| s.settings()).collect();
    let window = params.window.max(1);
    let spec = TrafficSpec {
        seed: params.seed,
        messages: params.messages,
        dup_rate: params.dup_rate,
        mismatch_rate: params.mismatch_rate,
        subscribers: params.subscribers.max(1),
        random_order_ids: params.random_order_ids,
    };
    // Fixed structures (active and sealing indexes, redb caches) peak once two
    // generations per shard and subscriber exist; RSS growth after that is per key.
    let warmup_keys = 2
        * params.config.ledger.generation_max_claims.get() as u64
        * shards as u64
        * params.subscribers.max(1) as u64;
    let submitted_at: Arc<Vec<AtomicU64>> =
        Arc::new((0..window).map(|_| AtomicU64::new(0)).collect());
    let released = Arc::new(AtomicU64::new(0));
    let p99_live = Arc::new(AtomicU64::new(0));
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    let start = Instant::now();
    let generator_thread = std::thread::current();

    let acker = {
        let submitted_at = submitted_at.clone();
        let released = released.clone();
        let p99_live = p99_live.clone();
        std::thread::Builder::new()
            .name("bench-acker".into())
            .spawn(move || {
                let mut order: Sequencer<u8> = Sequencer::starting_at(0);
                let mut r = AckerResult {
                    latency: Latency::default(),
                    counts: [0; 6],
                    rss_samples: Vec::new(),
                };
                let mut last_sample = Instant::now();
                for batch in ack_rx {
                    for d in batch {
                        let code = match d.outcome {
                            Outcome::Processed => 0,
                            Outcome::Duplicate => 1,
                            Outcome::Quarantined { .. } => 2,
                            Outcome::DeadLettered { .. } => 3,
                            Outcome::Rejected { .. } => 4,
                            Outcome::Failed { .. } => 5,
                        };
                        order.insert(d.seq, code);
                    }
                    let now = start.elapsed().as_micros() as u64;
                    while let Some((seq, code)) = order.pop_ready() {
                        let t = submitted_at[(seq % window) as usize].load(Ordering::Acquire);
                        r.latency.record_us(now.saturating_sub(t));
                        r.counts[code as usize] += 1;
                    }
                    if last_sample.elapsed() >= Duration::from_millis(250) {
                        last_sample = Instant::now();
                        r.rss_samples.push((r.counts[0], rss_bytes()));
                    }
                    released.store(order.watermark(), Ordering::Release);
                    if r.latency.count().is_multiple_of(64) {
                        p99_live.store(
                            (r.latency.quantile_ms(0.99) * 1000.0) as u64,
                            Ordering::Relaxed,
                        );
                    }
                    generator_thread.unpark();
                }
                r
            })
            .map_err(|e| BenchError::Naive(format!("cannot start acker: {e}")))?
    };

    let mut traffic = Traffic::new(spec);
    let mut ev = Event::default();
    let mut staged: Vec<Vec<Job>> = (0..shards).map(|_| Vec::new()).collect();
    let mut expected = [0u64; 3];
    let mut last_report = Instant::now();
    let flush = |staged: &mut Vec<Vec<Job>>| -> Result<(), LedgerError> {
        for (i, s) in staged.iter_mut().enumerate() {
            if !s.is_empty() {
                ledger.submit(i, std::mem::take(s))?;
            }
        }
        Ok(())
    };
    let mut seq = 0u64;
    while traffic.next_into(&mut ev) {
        while seq - released.load(Ordering::Acquire) >= window {
            flush(&mut staged)?;
            std::thread::park_timeout(Duration::from_micros(500));
            if let Some(r) = ledger.poison_reason() {
                return Err(LedgerError::Poisoned(r).into());
            }
        }
        match ev.expect {
            Some(Expect::New) => expected[0] += 1,
            Some(Expect::Duplicate) => expected[1] += 1,
            _ => expected[2] += 1,
        }
        let key = key_hash(ev.id.as_bytes());
        let sub = &subs[ev.subscriber as usize];
        let mut job = Job::new(
            seq,
            sub.id,
            key,
            fingerprint(&ev.payload),
            &ev.id,
            &ev.payload,
            ack_tx.clone(),
        );
        submitted_at[(seq % window) as usize]
            .store(start.elapsed().as_micros() as u64, Ordering::Release);
        let shard = place_event(&ledger, sub, &settings[ev.subscriber as usize], &mut job)?;
        staged[shard].push(job);
        if staged[shard].len() >= 256 {
            ledger.submit(shard, std::mem::take(&mut staged[shard]))?;
        }
        seq += 1;
        if seq.is_multiple_of(8192) && last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            progress(Progress {
                phase: "engine",
                done: released.load(Ordering::Relaxed),
                total: params.messages,
                elapsed: start.elapsed(),
                p99_ms: p99_live.load(Ordering::Relaxed) as f64 / 1000.0,
            });
        }
    }
    flush(&mut staged)?;
    while released.load(Ordering::Acquire) < seq {
        std::thread::park_timeout(Duration::from_millis(1));
        if let Some(r) = ledger.poison_reason() {
            return Err(LedgerError::Poisoned(r).into());
        }
    }
    let elapsed = start.elapsed();
    let rss_end = rss_bytes();
    drop(ack_tx);
    let report = ledger.report()?;
    let mut state_entries = 0;
    for s in &subs {
        state_entries += ledger.state_len(&s.name)?;
    }
    let metrics = ledger.metrics();
    let counters: Vec<_> = ledger.subscribers();
    ledger.close()?;
    let acked = acker
        .join()
        .map_err(|_| BenchError::Naive("acker panicked".into()))?;

    let stored_keys: u64 = report.subscribers.iter().map(|s| s.claims).sum();
    let filter_bytes: u64 = report.subscribers.iter().map(|s| s.filter_bytes).sum();
    let batches: u64 = metrics.iter().map(|m| m.batches).sum();
    let commits: u64 = metrics.iter().map(|m| m.commits).sum();
    let probes: u64 = counters
        .iter()
        .map(|c| c.counters.filter_probes.load(Ordering::Relaxed))
        .sum();
    let fps: u64 = counters
        .iter()
        .map(|c| c.counters.filter_false_positives.load(Ordering::Relaxed))
        .sum();
    let mean_batch = seq as f64 / batches.max(1) as f64;
    let mut samples: Vec<(u64, u64)> = acked
        .rss_samples
        .iter()
        .copied()
        .filter(|s| s.0 >= warmup_keys)
        .collect();
    samples.push((acked.counts[0], rss_end));
    let (rss_per_key, rss_base) = rss_slope(&samples).unwrap_or((f64::NAN, f64::NAN));
    let rss_max = acked
        .rss_samples
        .iter()
        .map(|s| s.1)
        .max()
        .unwrap_or(0)
        .max(rss_end);
    let msgs_per_sec = seq as f64 / elapsed.as_secs_f64();
    let disk_bytes = crate::ledger::dir_bytes(&data_dir);
    let verified = acked.counts[0] == expected[0]
        && acked.counts[1] == expected[1]
        && acked.counts[2] == expected[2]
        && acked.counts[3..].iter().all(|c| *c == 0);
    let dead_lettered = acked.counts[3];

    let naive_batch = mean_batch.round().max(1.0) as u64;
    let (naive_messages, naive_rate) = if params.naive_messages > 0 {
        let n = params.naive_messages;
        let rate = run_naive(
            &tmp.path().join("naive.redb"),
            TrafficSpec {
                messages: n,
                ..spec
            },
            naive_batch,
            params.config.ledger.cache_mib.get() * shards,
            &mut progress,
        )?;
        (n, rate)
    } else {
        (0, f64::NAN)
    };
    if params.keep {
        let _ = tmp.keep();
    }
    Ok(BenchReport {
        params: params.clone(),
        data_dir,
        shards,
        elapsed_s: elapsed.as_secs_f64(),
        msgs_per_sec,
        processed: acked.counts[0],
        duplicates: acked.counts[1],
        quarantined: acked.counts[2],
        verified,
        p50_ack_ms: acked.latency.quantile_ms(0.5),
        p99_ack_ms: acked.latency.quantile_ms(0.99),
        max_ack_ms: acked.latency.max_ms(),
        stored_keys,
        rss_base_bytes: rss_base.max(0.0) as u64,
        rss_end_bytes: rss_end,
        rss_max_bytes: rss_max,
        max_commit_ms: metrics.iter().map(|m| m.max_commit_us).max().unwrap_or(0) as f64 / 1000.0,
        rss_bytes_per_key: rss_per_key,
        filter_bytes_per_key: filter_bytes as f64 / stored_keys.max(1) as f64,
        disk_bytes,
        batches,
        commits,
        mean_batch,
        max_batch_ms_plain: metrics
            .iter()
            .map(|m| m.max_batch_us_plain)
            .max()
            .unwrap_or(0) as f64
            / 1000.0,
        max_batch_ms_with_maintenance: metrics
            .iter()
            .map(|m| m.max_batch_us_maintenance)
            .max()
            .unwrap_or(0) as f64
            / 1000.0,
        seals: metrics.iter().map(|m| m.seals).sum(),
        merges: metrics.iter().map(|m| m.merges).sum(),
        filter_probes: probes,
        filter_false_positive_rate: fps as f64 / probes.max(1) as f64,
        state_entries,
        dead_lettered,
        naive_messages,
        naive_batch,
        naive_msgs_per_sec: naive_rate,
        engine_over_naive: msgs_per_sec / naive_rate,
    })
}

/// The baseline a careful user would write first: one redb table keyed by the 128-bit id
/// hash, one durable commit per batch of the engine's mean batch size, get-then-insert per
/// message, random keys. Same traffic, same hashing, same cache budget.
fn run_naive(
    path: &Path,
    spec: TrafficSpec,
    batch: u64,
    cache_mib: usize,
    progress: &mut impl FnMut(Progress),
) -> Result<f64, BenchError> {
    let e = |x: &dyn std::fmt::Display| BenchError::Naive(x.to_string());
    let naive = crate::ledger::NaiveBaseline::create(path, cache_mib).map_err(|x| e(&x))?;
    let mut traffic = Traffic::new(spec);
    let mut ev = Event::default();
    let start = Instant::now();
    let mut last = Instant::now();
    let mut done = 0u64;
    let mut pending: Vec<(u128, u64)> = Vec::with_capacity(batch as usize);
    let mut more = true;
    while more {
        pending.clear();
        while (pending.len() as u64) < batch {
            if !traffic.next_into(&mut ev) {
                more = false;
                break;
            }
            pending.push((key_hash(ev.id.as_bytes()), fingerprint(&ev.payload)));
        }
        if pending.is_empty() {
            break;
        }
        naive.claim_batch(&pending).map_err(|x| e(&x))?;
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
    Ok(done as f64 / start.elapsed().as_secs_f64())
}
