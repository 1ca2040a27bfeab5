//! The soak (`dedupd-bench soak`, which also draws its curves; `tests/soak.rs` runs a
//! short one): a long run at a steady fraction of capacity with a short TTL, so
//! sealing, merging and expiry run all the time (issue 14, item 7).
//!
//! First a short closed-loop run on a scratch data directory measures what the engine
//! takes with these settings (its capacity); then a fresh engine is offered `load` (70 %)
//! of it, paced by the clock, for the soak's duration. Latency is measured from each
//! message's *scheduled* time to the release of its outcome in source order, so a stall
//! shows as latency and backlog rather than as a pause of the generator. Every
//! `sample_every` a [`SoakSample`] records resident memory, the data directory's allocated
//! bytes, the interval's p50/p99, claims stored, sealed generations, seals, merges and
//! dropped generations, and the backlog (messages scheduled but not yet acknowledged).
//!
//! [`judge`] turns the samples into the pass/fail criteria, each with its figures:
//! memory and disk bounded (the second half's peak within `GROWTH_LIMIT` of the first
//! half's, or growing only with bounded stored claims), p99 never above twice its first-minute value, compaction keeping up (stored
//! claims and sealed generations bounded the same way, generations dropped by expiry) and
//! the offered rate served (backlog at the end under a second of traffic).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use serde::Serialize;

use crate::clock::SystemClock;
use crate::config::Config;
use crate::envelope::{fingerprint, key_hash};
use crate::ledger::{Done, Job, Ledger, LedgerError, Outcome};
use crate::pipeline::Sequencer;
use crate::source::generator::{Event, Traffic, TrafficSpec};
use crate::telemetry::{rss_bytes, Latency};

use super::BenchError;

/// How much the second half's peak may exceed the first half's (memory, disk, claims,
/// generations) before the soak calls it growth rather than noise.
pub(crate) const GROWTH_LIMIT: f64 = 1.25;
/// Sealed generations may step up by this many past `GROWTH_LIMIT` (each subscriber and
/// shard holds up to the merge trigger, 4, between merges).
const GENERATION_SLACK: u64 = 4;
/// How far the second half's trend may rise, as a fraction of the first half's peak.
pub const TREND_LIMIT: f64 = 0.1;
/// How far any interval's p99 may rise over the first minute's p99.
pub const P99_LIMIT: f64 = 2.0;

/// Parameters of one soak.
#[derive(Debug, Clone, Serialize)]
pub struct SoakParams {
    /// Length of the paced run.
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
    /// Length of the closed-loop capacity measurement before it.
    #[serde(with = "humantime_serde")]
    pub capacity_duration: Duration,
    /// Fraction of the measured capacity offered.
    pub load: f64,
    /// Offer this many messages per second instead of measuring capacity.
    pub rate: Option<f64>,
    #[serde(with = "humantime_serde")]
    pub sample_every: Duration,
    /// The subscribers' TTL: claims expire and whole generations are dropped after it.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// Claims per active generation before it is sealed.
    pub generation_claims: usize,
    pub subscribers: u32,
    pub dup_rate: f64,
    pub seed: u64,
    /// Most messages in flight; the paced generator waits beyond it (the backlog grows).
    pub window: u64,
    /// Where the scratch data directories are created.
    pub dir: PathBuf,
    #[serde(skip)]
    pub config: Config,
}

/// One sample of the paced run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SoakSample {
    /// Seconds since the paced run started.
    pub t_s: f64,
    pub rss_bytes: u64,
    /// Bytes the data directory's files take on the disk.
    pub disk_allocated_bytes: u64,
    /// Messages acknowledged per second within the interval.
    pub msgs_per_sec: f64,
    /// Acknowledgement latency within the interval (from each message's scheduled time).
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Messages scheduled by now and not yet acknowledged.
    pub backlog: u64,
    /// Claims stored (expired ones not yet dropped included).
    pub claims: u64,
    pub sealed_generations: u64,
    /// Since the start (all shards).
    pub seals: u64,
    pub merges: u64,
    pub dropped_generations: u64,
}

/// One pass/fail criterion with the figures it was decided on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub passed: bool,
    pub detail: String,
}

/// Everything a soak measured.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub params: SoakParams,
    pub shards: usize,
    /// Closed-loop messages per second (0 when `rate` was given).
    pub capacity_msgs_per_sec: f64,
    pub offered_msgs_per_sec: f64,
    pub(crate) achieved_msgs_per_sec: f64,
    pub messages: u64,
    pub processed: u64,
    pub duplicates: u64,
    /// Outcomes other than processed and duplicate (always a defect here).
    pub other: u64,
    /// The p99 of every acknowledgement in the first minute (or first third of a shorter
    /// run): the reference of the p99 criterion.
    pub first_minute_p99_ms: f64,
    pub samples: Vec<SoakSample>,
    pub checks: Vec<Check>,
}

impl SoakReport {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }
}

/// The settings a soak runs with: the given config, with the soak's TTL for every
/// subscriber and generations small and young enough to seal, merge and expire within it.
pub(crate) fn soak_config(params: &SoakParams) -> Config {
    let mut config = params.config.clone();
    config.defaults.ttl = params.ttl;
    let claims = params.generation_claims.clamp(16, 1 << 24);
    config.ledger.generation_max_claims =
        std::num::NonZeroUsize::new(claims).unwrap_or(config.ledger.generation_max_claims);
    config.ledger.generation_max_age = (params.ttl / 8).max(Duration::from_millis(500));
    config.ledger.merge_trigger_generations =
        std::num::NonZeroUsize::new(4).unwrap_or(config.ledger.merge_trigger_generations);
    config.ledger.merge_max_claims = std::num::NonZeroUsize::new((claims * 8).clamp(16, 1 << 30))
        .unwrap_or(config.ledger.merge_max_claims);
    for i in 0..params.subscribers.max(1) {
        let name = format!("soak-{i}");
        if !config.subscribers.iter().any(|s| s.name == name) {
            config.subscribers.push(crate::config::SubscriberConfig {
                name,
                ..Default::default()
            });
        }
    }
    config
}

/// Measures capacity (unless `rate` is given), then runs the paced soak.
pub fn run_soak(
    params: &SoakParams,
    mut progress: impl FnMut(&str),
) -> Result<SoakReport, BenchError> {
    let config = soak_config(params);
    let (capacity, offered) = match params.rate {
        Some(rate) => (0.0, rate),
        None => {
            progress(&format!(
                "capacity: closed loop for {:.0} s",
                params.capacity_duration.as_secs_f64()
            ));
            let tmp = scratch(params)?;
            let ledger = Ledger::open(&tmp.path().join("engine"), &config, Arc::new(SystemClock))?;
            let run = drive(
                &ledger,
                params,
                None,
                params.capacity_duration,
                |_| SoakSample::default(),
                &mut |_| {},
            )?;
            ledger.close()?;
            let capacity = run.acked as f64 / params.capacity_duration.as_secs_f64();
            (capacity, capacity * params.load)
        }
    };
    progress(&format!(
        "soak: {offered:.0} msgs/s (capacity {capacity:.0}) for {:.0} s",
        params.duration.as_secs_f64()
    ));
    let tmp = scratch(params)?;
    let data_dir = tmp.path().join("engine");
    let ledger = Ledger::open(&data_dir, &config, Arc::new(SystemClock))?;
    let mut samples = Vec::new();
    let run = drive(
        &ledger,
        params,
        Some(offered),
        params.duration,
        |ledger| sample(ledger, &data_dir),
        &mut |s: SoakSample| {
            progress(&format!(
                "t {:>5.0} s  {:>8.0} msgs/s  p99 {:>7.2} ms  rss {:>6.1} MiB  disk {:>6.1} MiB  claims {:>8}  gens {:>3}  backlog {}",
                s.t_s,
                s.msgs_per_sec,
                s.p99_ms,
                s.rss_bytes as f64 / 1048576.0,
                s.disk_allocated_bytes as f64 / 1048576.0,
                s.claims,
                s.sealed_generations,
                s.backlog
            ));
            samples.push(s);
        },
    )?;
    let shards = ledger.shard_count();
    ledger.close()?;
    let first_minute = first_window(params.duration);
    let checks = judge(&samples, run.first_p99_ms, offered, first_minute);
    Ok(SoakReport {
        params: params.clone(),
        shards,
        capacity_msgs_per_sec: capacity,
        offered_msgs_per_sec: offered,
        achieved_msgs_per_sec: run.acked as f64 / run.elapsed.as_secs_f64(),
        messages: run.acked,
        processed: run.counts.processed,
        duplicates: run.counts.duplicates,
        other: run.counts.other,
        first_minute_p99_ms: run.first_p99_ms,
        samples,
        checks,
    })
}

fn scratch(params: &SoakParams) -> Result<tempfile::TempDir, BenchError> {
    tempfile::Builder::new()
        .prefix(".dedupd-soak-")
        .tempdir_in(&params.dir)
        .map_err(|e| BenchError::Dir(params.dir.clone(), e))
}

/// The reference window of the p99 criterion: the first minute, or the first third of a
/// run shorter than three minutes.
pub(crate) fn first_window(duration: Duration) -> Duration {
    Duration::from_secs(60).min(duration / 3)
}

/// The engine-side part of a sample (the driver fills in rate, latency and backlog).
fn sample(ledger: &Ledger, data_dir: &std::path::Path) -> SoakSample {
    let metrics = ledger.metrics();
    let (claims, sealed) = ledger.report().map_or((0, 0), |r| {
        r.subscribers
            .iter()
            .fold((0, 0), |(c, g), s| (c + s.claims, g + s.sealed_generations))
    });
    SoakSample {
        rss_bytes: rss_bytes(),
        disk_allocated_bytes: crate::ledger::dir_allocated_bytes(data_dir),
        claims,
        sealed_generations: sealed,
        seals: metrics.iter().map(|m| m.seals).sum(),
        merges: metrics.iter().map(|m| m.merges).sum(),
        dropped_generations: metrics.iter().map(|m| m.dropped_generations).sum(),
        ..Default::default()
    }
}

/// What the acker measures and the driver samples.
#[derive(Default)]
struct Interval {
    latency: Latency,
    acked: u64,
}

#[derive(Default)]
struct Acked {
    /// Every message below this seq has its outcome released.
    released: AtomicU64,
    interval: Mutex<Interval>,
    /// Every acknowledgement of the first window.
    first: Mutex<Latency>,
}

impl Acked {
    /// Completes `s` with the interval `(from, now)`'s figures (taking them) and the
    /// backlog of `scheduled` messages.
    fn complete(
        &self,
        mut s: SoakSample,
        (from, now): (Duration, Duration),
        scheduled: u64,
    ) -> SoakSample {
        let interval =
            std::mem::take(&mut *self.interval.lock().unwrap_or_else(|p| p.into_inner()));
        let secs = (now - from).as_secs_f64().max(1e-9);
        s.t_s = now.as_secs_f64();
        s.msgs_per_sec = interval.acked as f64 / secs;
        s.p50_ms = interval.latency.quantile_ms(0.5);
        s.p99_ms = interval.latency.quantile_ms(0.99);
        s.max_ms = interval.latency.max_ms();
        s.backlog = scheduled.saturating_sub(self.released.load(Ordering::Acquire));
        s
    }
}

struct DriveResult {
    acked: u64,
    elapsed: Duration,
    counts: Released,
    first_p99_ms: f64,
}

/// The outcomes released, by kind.
#[derive(Debug, Default, Clone, Copy)]
struct Released {
    processed: u64,
    duplicates: u64,
    /// Anything else (quarantined, dead-lettered, rejected).
    other: u64,
}

impl Released {
    fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Processed => self.processed += 1,
            Outcome::Duplicate => self.duplicates += 1,
            _ => self.other += 1,
        }
    }
}

/// The thread that releases outcomes in source order, records each one's latency (from
/// its due time when paced at `rate`, else from its submission in `submitted_at`) and
/// wakes the driver.
fn spawn_acker(
    acked: Arc<Acked>,
    submitted_at: Arc<Vec<AtomicU64>>,
    ack_rx: crossbeam_channel::Receiver<Vec<Done>>,
    (start, first_window, rate): (Instant, Duration, Option<f64>),
) -> Result<std::thread::JoinHandle<Released>, BenchError> {
    let window = submitted_at.len() as u64;
    let driver = std::thread::current();
    std::thread::Builder::new()
        .name("soak-acker".into())
        .spawn(move || {
            let mut order: Sequencer<Outcome> = Sequencer::starting_at(0);
            let mut counts = Released::default();
            for batch in ack_rx {
                for d in batch {
                    order.insert(d.seq, d.outcome);
                }
                let now = start.elapsed();
                let now_us = now.as_micros() as u64;
                let mut interval = acked.interval.lock().unwrap_or_else(|p| p.into_inner());
                let mut first = (now < first_window)
                    .then(|| acked.first.lock().unwrap_or_else(|p| p.into_inner()));
                while let Some((seq, outcome)) = order.pop_ready() {
                    let sent_us = match rate {
                        Some(r) => (seq as f64 * 1e6 / r) as u64,
                        None => submitted_at[(seq % window) as usize].load(Ordering::Acquire),
                    };
                    let us = now_us.saturating_sub(sent_us);
                    interval.latency.record_us(us);
                    interval.acked += 1;
                    if let Some(f) = first.as_mut() {
                        f.record_us(us);
                    }
                    counts.count(&outcome);
                }
                drop((interval, first));
                acked.released.store(order.watermark(), Ordering::Release);
                driver.unpark();
            }
            counts
        })
        .map_err(|e| BenchError::Naive(format!("cannot start the soak acker: {e}")))
}

/// Offers traffic for `duration` (paced at `rate`, or closed-loop within the window when
/// `None`), releasing outcomes in source order on an acker thread; every `sample_every`
/// takes `probe`'s sample, completes it with the interval's figures and hands it to
/// `on_sample`. Returns once every offered message is acknowledged.
fn drive(
    ledger: &Ledger,
    params: &SoakParams,
    rate: Option<f64>,
    duration: Duration,
    probe: impl Fn(&Ledger) -> SoakSample,
    on_sample: &mut dyn FnMut(SoakSample),
) -> Result<DriveResult, BenchError> {
    let subs: Vec<_> = (0..params.subscribers.max(1))
        .map(|i| ledger.subscriber(&format!("soak-{i}")))
        .collect::<Result<_, _>>()?;
    let mut traffic = Traffic::new(TrafficSpec {
        seed: params.seed,
        messages: u64::MAX,
        dup_rate: params.dup_rate,
        mismatch_rate: 0.0,
        subscribers: params.subscribers.max(1),
        random_order_ids: false,
        orders: None,
    });
    let window = params.window.max(1);
    let first_window = first_window(duration);
    let acked = Arc::new(Acked::default());
    let start = Instant::now();
    // Closed loop: latency from submission, kept per window slot.
    let submitted_at: Arc<Vec<AtomicU64>> =
        Arc::new((0..window).map(|_| AtomicU64::new(0)).collect());
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    let acker = spawn_acker(
        acked.clone(),
        submitted_at.clone(),
        ack_rx,
        (start, first_window, rate),
    )?;
    let settings: Vec<_> = subs.iter().map(|s| s.settings()).collect();
    let mut staged: Vec<Vec<Job>> = (0..ledger.shard_count()).map(|_| Vec::new()).collect();
    let mut ev = Event::default();
    let mut seq = 0u64;
    let mut next_sample = params.sample_every;
    let mut last_sample = Duration::ZERO;
    let result = (|| -> Result<(), BenchError> {
        loop {
            let now = start.elapsed();
            if now >= duration {
                break;
            }
            let due = match rate {
                Some(r) => (now.as_secs_f64() * r) as u64,
                None => u64::MAX,
            };
            let released = acked.released.load(Ordering::Acquire);
            let mut room = (released + window).saturating_sub(seq);
            while seq < due && room > 0 && staged.iter().map(Vec::len).sum::<usize>() < 4096 {
                traffic.next_into(&mut ev);
                let sub = &subs[ev.subscriber as usize];
                let mut job = Job::new(
                    seq,
                    sub.id,
                    key_hash(ev.id.as_bytes()),
                    fingerprint(&ev.payload),
                    &ev.id,
                    &ev.payload,
                    ack_tx.clone(),
                );
                submitted_at[(seq % window) as usize]
                    .store(start.elapsed().as_micros() as u64, Ordering::Release);
                let shard =
                    super::place_event(ledger, sub, &settings[ev.subscriber as usize], &mut job)?;
                staged[shard].push(job);
                seq += 1;
                room -= 1;
            }
            for (i, s) in staged.iter_mut().enumerate() {
                if !s.is_empty() {
                    ledger.submit(i, std::mem::take(s))?;
                }
            }
            if let Some(r) = ledger.poison_reason() {
                return Err(LedgerError::Poisoned(r).into());
            }
            if now >= next_sample {
                next_sample += params.sample_every;
                let scheduled = if rate.is_some() { due } else { seq };
                on_sample(acked.complete(probe(ledger), (last_sample, now), scheduled));
                last_sample = now;
            }
            match rate {
                // Paced: wake for the next millisecond's messages (or an ack that frees room).
                Some(_) => std::thread::park_timeout(Duration::from_millis(1)),
                None if room == 0 => std::thread::park_timeout(Duration::from_micros(500)),
                None => {}
            }
        }
        while acked.released.load(Ordering::Acquire) < seq {
            std::thread::park_timeout(Duration::from_millis(1));
            if let Some(r) = ledger.poison_reason() {
                return Err(LedgerError::Poisoned(r).into());
            }
        }
        Ok(())
    })();
    let elapsed = start.elapsed();
    drop(ack_tx);
    let counts = acker
        .join()
        .map_err(|_| BenchError::Naive("the soak acker panicked".into()))?;
    result?;
    let first_p99_ms = acked
        .first
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .quantile_ms(0.99);
    Ok(DriveResult {
        acked: seq,
        elapsed,
        counts,
        first_p99_ms,
    })
}

/// The names of the checks that failed.
pub fn failed(checks: &[Check]) -> Vec<&'static str> {
    checks
        .iter()
        .filter(|c| !c.passed)
        .map(|c| c.name)
        .collect()
}

/// Whether `values` stopped growing: the second half's peak within `GROWTH_LIMIT` of the
/// first half's, and the second half's trend (a least-squares line) rising by at most
/// `TREND_LIMIT` of the first half's peak, each plus `slack` (for small counts that step by
/// one). The peak alone passes a slow leak from a high base in a short run (80 MiB growing
/// 2 MiB per sample passes 1.25x over 24 samples); the trend catches it.
/// Returns `(passed, first-half peak, second-half peak)`.
fn bounded(values: &[u64], slack: u64) -> (bool, u64, u64) {
    let v: Vec<f64> = values.iter().map(|v| *v as f64).collect();
    let (ok, a, b) = bounded_f64(&v, slack as f64);
    (ok, a as u64, b as u64)
}

fn bounded_f64(values: &[f64], slack: f64) -> (bool, f64, f64) {
    let half = values.len() / 2;
    let peak = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (first, second) = (peak(&values[..half]), peak(&values[half..]));
    let peak_ok = second <= first * GROWTH_LIMIT + slack;
    let trend_ok = rise(&values[half..]) <= first * TREND_LIMIT + slack;
    (peak_ok && trend_ok, first, second)
}

/// `bytes` per stored claim at the claims' high-water mark so far: flat while the bytes
/// follow the claims (files and indexes grow to the most claims ever held and keep that
/// size), rising when they grow on their own.
fn per_claim_high_water(bytes: &[u64], claims: &[u64]) -> Vec<f64> {
    let mut high = 0u64;
    bytes
        .iter()
        .zip(claims)
        .map(|(b, c)| {
            high = high.max(*c).max(1);
            *b as f64 / high as f64
        })
        .collect()
}

/// How much a least-squares line through evenly spaced `values` rises from the first to
/// the last (negative when it falls).
fn rise(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 2 {
        return 0.0;
    }
    let xbar = (n - 1) as f64 / 2.0;
    let ybar = values.iter().sum::<f64>() / n as f64;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (i, v) in values.iter().enumerate() {
        let dx = i as f64 - xbar;
        sxy += dx * (v - ybar);
        sxx += dx * dx;
    }
    sxy / sxx * (n - 1) as f64
}

/// The soak's pass/fail criteria over its samples. `first_p99_ms` is the p99 of the
/// acknowledgements within `first` (the first minute); `offered` the paced rate.
pub fn judge(
    samples: &[SoakSample],
    first_p99_ms: f64,
    offered: f64,
    first: Duration,
) -> Vec<Check> {
    let mib = |b: u64| b as f64 / 1048576.0;
    let mut checks = Vec::new();
    let enough = samples.len() >= 4;
    checks.push(Check {
        name: "samples",
        passed: enough,
        detail: format!("{} samples (at least 4 to compare halves)", samples.len()),
    });
    if !enough {
        return checks;
    }
    let col = |f: fn(&SoakSample) -> u64| samples.iter().map(f).collect::<Vec<_>>();
    let claims = col(|s| s.claims);
    let (claims_ok, a, b) = bounded(&claims, 0);
    // Memory and disk: the same bound on a byte series, described alike. A series that
    // grew passes when it only followed the claims (a stall's backlog served in a burst
    // holds more claims within the TTL) and the claims themselves stayed bounded.
    let bytes_bounded = |name: &'static str, what: &str, f: fn(&SoakSample) -> u64| {
        let v = col(f);
        let (raw_ok, a, b) = bounded(&v, 0);
        let per = per_claim_high_water(&v, &claims);
        let (per_ok, pa, pb) = bounded_f64(&per, 0.0);
        Check {
            name,
            passed: raw_ok || (per_ok && claims_ok),
            detail: format!(
                "{what} peak {:.1} MiB in the first half, {:.1} MiB in the second; per stored claim at its high-water mark {pa:.1} B then {pb:.1} B (limits x{GROWTH_LIMIT}, trend +{TREND_LIMIT}x; the bytes may follow bounded claims); start {:.1}, end {:.1} MiB",
                mib(a),
                mib(b),
                mib(v[0]),
                mib(v[v.len() - 1])
            ),
        }
    };
    checks.push(bytes_bounded("memory bounded", "RSS", |s| s.rss_bytes));
    checks.push(bytes_bounded("disk bounded", "allocated", |s| {
        s.disk_allocated_bytes
    }));
    let worst = samples
        .iter()
        .max_by(|x, y| x.p99_ms.total_cmp(&y.p99_ms))
        .copied()
        .unwrap_or_default();
    checks.push(Check {
        name: "p99 within 2x of the first minute",
        passed: worst.p99_ms <= P99_LIMIT * first_p99_ms,
        detail: format!(
            "first {:.0} s p99 {:.2} ms; worst interval p99 {:.2} ms at {:.0} s (limit {:.2} ms)",
            first.as_secs_f64(),
            first_p99_ms,
            worst.p99_ms,
            worst.t_s,
            P99_LIMIT * first_p99_ms
        ),
    });
    let (gens_ok, ga, gb) = bounded(&col(|s| s.sealed_generations), GENERATION_SLACK);
    let last = samples[samples.len() - 1];
    let expired = last.dropped_generations > 0;
    checks.push(Check {
        name: "compaction keeps up",
        passed: claims_ok && gens_ok && expired && last.seals > 0,
        detail: format!(
            "claims stored peak {a} then {b}, sealed generations peak {ga} then {gb}; {} seals, {} merges, {} generations dropped by expiry",
            last.seals, last.merges, last.dropped_generations
        ),
    });
    let backlog_limit = offered.max(1.0) as u64;
    let worst_backlog = samples.iter().map(|s| s.backlog).max().unwrap_or(0);
    checks.push(Check {
        name: "offered rate served",
        passed: last.backlog <= backlog_limit,
        detail: format!(
            "backlog {} at the last sample, worst {worst_backlog} (limit: one second of traffic, {backlog_limit})",
            last.backlog
        ),
    });
    checks
}

impl std::fmt::Display for SoakReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.params;
        writeln!(
            f,
            "soak     {:.0} s at {:.0} msgs/s ({:.0} % of {:.0} measured), achieved {:.0} msgs/s; {} shards, TTL {:.0} s, generations of {} claims",
            p.duration.as_secs_f64(),
            self.offered_msgs_per_sec,
            p.load * 100.0,
            self.capacity_msgs_per_sec,
            self.achieved_msgs_per_sec,
            self.shards,
            p.ttl.as_secs_f64(),
            p.generation_claims
        )?;
        writeln!(
            f,
            "outcomes {} messages: processed {}  duplicate {}  other {}",
            self.messages, self.processed, self.duplicates, self.other
        )?;
        for c in &self.checks {
            writeln!(
                f,
                "{:<4}     {}: {}",
                if c.passed { "PASS" } else { "FAIL" },
                c.name,
                c.detail
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
