//! `dedupd bench adversarial`: well-behaved handlers next to hostile ones in one engine
//! (issue 14, item 6).
//!
//! Fifteen subscribers run a well-behaved handler (`fixture-counter`: `count/<order>` =
//! get + 1, deliberately not idempotent); five run hostile ones: one traps on every
//! message, one spins forever, one grows its memory to the cap, one floods the log (and
//! otherwise counts like the good ones), one sleeps in a host call. Every subscriber is
//! its own source with its own window of messages in flight (as separate consumers
//! would be), and every subscriber is sent the same message ids, so a claim of one that
//! hid a message from another (G5) would change a count.
//!
//! Two phases run in the same process on fresh data directories: the good subscribers
//! alone (the baseline), then the same good traffic with the hostile subscribers sending
//! `bad_messages` each alongside. The figure is the good subscribers' throughput in the
//! second phase over the first. Each phase checks its outcomes and state exactly: every
//! unique message of a succeeding handler processed once and its redeliveries duplicates,
//! every count exact, every message of a failing handler dead-lettered with its kind of
//! failure and nothing of it stored (G6).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use serde::Serialize;

use crate::clock::SystemClock;
use crate::config::{Config, PartitionSource, SubscriberConfig};
use crate::effects::HandlerFactory;
use crate::envelope::{fingerprint, key_hash};
use crate::ledger::{entity_scope, Done, Job, Ledger, LedgerError, Outcome};

use super::params::{self, ParamError};
use super::BenchError;

/// What a subscriber's handler does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Behaviour {
    /// `fixture-counter`: counts every event of an order.
    Good,
    /// `fixture-trap`: writes, then panics.
    Trap,
    /// `fixture-loop`: writes, then spins until the CPU budget stops it.
    Loop,
    /// `fixture-memory-hog`: grows its memory until the cap refuses it.
    MemoryHog,
    /// `fixture-log-flood`: 1,000 `log` calls and ~80 KiB of output per message, then
    /// counts like `Good`.
    LogFlood,
    /// `fixture-sleep`: sleeps 5 s in a host call; the budget ends it.
    Sleep,
}

impl Behaviour {
    /// The five hostile behaviours, in the order their subscribers are created.
    pub const HOSTILE: [Behaviour; 5] = [
        Behaviour::Trap,
        Behaviour::Loop,
        Behaviour::MemoryHog,
        Behaviour::LogFlood,
        Behaviour::Sleep,
    ];

    /// The component's file name as `plugins/build.sh` writes it.
    pub fn component(self) -> &'static str {
        match self {
            Behaviour::Good => "fixture_counter.wasm",
            Behaviour::Trap => "fixture_trap.wasm",
            Behaviour::Loop => "fixture_loop.wasm",
            Behaviour::MemoryHog => "fixture_memory_hog.wasm",
            Behaviour::LogFlood => "fixture_log_flood.wasm",
            Behaviour::Sleep => "fixture_sleep.wasm",
        }
    }

    fn subscriber(self, i: u32) -> String {
        match self {
            Behaviour::Good => format!("good-{i:02}"),
            Behaviour::Trap => "bad-trap".into(),
            Behaviour::Loop => "bad-loop".into(),
            Behaviour::MemoryHog => "bad-memory".into(),
            Behaviour::LogFlood => "bad-logs".into(),
            Behaviour::Sleep => "bad-sleep".into(),
        }
    }

    /// Whether its messages are processed (and counted) rather than dead-lettered.
    pub fn succeeds(self) -> bool {
        matches!(self, Behaviour::Good | Behaviour::LogFlood)
    }

    /// What a failing handler's dead letters say (`Failure`'s text), any one of these. A
    /// memory hog may also run out of its CPU budget before the cap stops it: it touches
    /// every byte up to 32 MiB, and on a busy machine 10 ms may end first.
    pub(crate) fn expected_reasons(self) -> &'static [&'static str] {
        match self {
            Behaviour::Trap => &["trapped"],
            Behaviour::Loop | Behaviour::Sleep => &["CPU budget"],
            Behaviour::MemoryHog => &["memory cap", "CPU budget"],
            Behaviour::Good | Behaviour::LogFlood => &[],
        }
    }
}

/// Parameters of one run.
#[derive(Debug, Clone, Serialize)]
pub struct AdversarialParams {
    /// Subscribers with the well-behaved handler.
    pub good_subscribers: u32,
    /// Messages sent to each good subscriber (redeliveries included), in both phases.
    pub messages: u64,
    /// Messages sent to each hostile subscriber in the second phase.
    pub bad_messages: u64,
    /// Distinct orders per subscriber (the counters).
    pub orders: u64,
    /// Every this many messages of a subscriber is a redelivery of an earlier one (0: none).
    pub redeliver_every: u64,
    /// Messages in flight per subscriber.
    pub window: u64,
    /// Directory holding the fixture components (`plugins/target/wasm32-wasip2/release`).
    pub components: PathBuf,
    /// Where the scratch data directories are created.
    pub dir: PathBuf,
    /// Ledger settings and subscriber defaults (budget, memory cap, attempts, backoff).
    #[serde(skip)]
    pub config: Config,
}

impl AdversarialParams {
    /// Refuses parameters the run cannot use: `messages`, `good_subscribers` and `orders`
    /// are at least 1. [`run_adversarial`] calls it first.
    pub fn validate(&self) -> Result<(), ParamError> {
        params::at_least_one("messages", self.messages)?;
        params::at_least_one("good_subscribers", self.good_subscribers)?;
        params::at_least_one("orders", self.orders)
    }
}

/// One subscriber's outcomes in one phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Tally {
    pub subscriber: String,
    pub behaviour: Option<Behaviour>,
    pub sent: u64,
    /// Distinct ids among `sent`.
    pub unique: u64,
    pub processed: u64,
    pub duplicates: u64,
    pub dead_lettered: u64,
    /// Any other outcome (quarantined, rejected, failed): always a defect here.
    pub(crate) other: u64,
    /// Claims the ledger holds for the subscriber at the end.
    pub claims: u64,
    /// Handler state entries at the end.
    pub state_entries: u64,
    /// The first dead letter's reason, if any.
    pub first_reason: Option<String>,
    /// Dead letters whose reason lacked the behaviour's expected text.
    pub(crate) unexpected_reasons: u64,
    /// Seconds from the phase's start to the subscriber's last outcome.
    pub(crate) last_outcome_s: f64,
    /// Handler calls set aside while it used more than its share of a shard's time.
    pub(crate) calls_deferred: u64,
}

/// One phase: the good subscribers alone, or with the hostile ones.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PhaseReport {
    pub(crate) with_hostile: bool,
    pub(crate) shards: usize,
    pub elapsed_s: f64,
    pub(crate) good_messages: u64,
    /// Seconds from the start to the good subscribers' last outcome.
    pub(crate) good_elapsed_s: f64,
    /// `good_messages / good_elapsed_s`.
    pub good_msgs_per_sec: f64,
    pub subscribers: Vec<Tally>,
    /// Every difference from what the traffic must give; empty when exact.
    pub(crate) problems: Vec<String>,
}

/// Both phases and their ratio.
#[derive(Debug, Clone, Serialize)]
pub struct AdversarialReport {
    pub(crate) params: AdversarialParams,
    pub shards: usize,
    pub baseline: PhaseReport,
    pub mixed: PhaseReport,
    /// Good subscribers' throughput with the hostile ones over without (target >= 0.8).
    pub ratio: f64,
    /// How much longer the good traffic took with the hostile subscribers, per hostile
    /// message sent: what one hostile message costs its neighbours (a failing one runs
    /// `max_attempts` times, each up to the CPU budget).
    pub(crate) extra_ms_per_hostile_message: f64,
}

impl AdversarialReport {
    /// Both phases' outcomes and state were exact.
    pub fn verified(&self) -> bool {
        self.baseline.problems.is_empty() && self.mixed.problems.is_empty()
    }
}

/// One subscriber of a phase and its traffic.
struct Lane {
    name: String,
    behaviour: Behaviour,
    quota: u64,
    sent: u64,
    /// Distinct ids sent so far (`m-0` .. `m-{unique-1}`).
    unique: u64,
}

impl Lane {
    /// The next message's id number and whether it redelivers an earlier one.
    fn next(&mut self, redeliver_every: u64) -> (u64, bool) {
        let j = self.sent;
        self.sent += 1;
        if redeliver_every > 0 && self.unique > 0 && j % redeliver_every == redeliver_every - 1 {
            return ((j / 2).min(self.unique - 1), true);
        }
        self.unique += 1;
        (self.unique - 1, false)
    }
}

fn payload(n: u64, orders: u64) -> String {
    format!(r#"{{"n":{n},"order_id":"o-{}"}}"#, n % orders.max(1))
}

/// Runs the baseline, then the mixed phase, each on a fresh data directory.
pub fn run_adversarial(
    params: &AdversarialParams,
    mut progress: impl FnMut(&str),
) -> Result<AdversarialReport, BenchError> {
    params.validate()?;
    let config = adversarial_config(params);
    let mut factories = BTreeMap::new();
    for b in std::iter::once(Behaviour::Good).chain(Behaviour::HOSTILE) {
        let path = params.components.join(b.component());
        let settings = config
            .subscribers
            .iter()
            .find(|s| s.name == b.subscriber(0))
            .map_or_else(|| config.defaults.clone(), |s| s.resolve(&config.defaults));
        let limits = crate::pipeline::limits_of(&settings);
        factories.insert(b.component(), crate::handler::load_factory(&path, limits)?);
    }
    progress("baseline: the good subscribers alone");
    let baseline = run_phase(params, &config, &factories, false)?;
    progress("mixed: the good subscribers next to the hostile ones");
    let mixed = run_phase(params, &config, &factories, true)?;
    let ratio = mixed.good_msgs_per_sec / baseline.good_msgs_per_sec.max(f64::MIN_POSITIVE);
    let hostile = (Behaviour::HOSTILE.len() as u64 * params.bad_messages).max(1);
    let extra_ms_per_hostile_message =
        (mixed.good_elapsed_s - baseline.good_elapsed_s) * 1e3 / hostile as f64;
    Ok(AdversarialReport {
        params: params.clone(),
        shards: baseline.shards,
        baseline,
        mixed,
        ratio,
        extra_ms_per_hostile_message,
    })
}

/// The run's config: every subscriber configured, state per order.
fn adversarial_config(params: &AdversarialParams) -> Config {
    let mut config = params.config.clone();
    config.allow_unknown_subscribers = false;
    let names = (0..params.good_subscribers)
        .map(|i| Behaviour::Good.subscriber(i))
        .chain(Behaviour::HOSTILE.iter().map(|b| b.subscriber(0)));
    for name in names {
        if !config.subscribers.iter().any(|s| s.name == name) {
            // The flood is about the log's volume, not CPU: its ~5,000 host calls per
            // message take ~5 ms, half the default budget, and on a busy machine a
            // message sometimes ran out of it three times and was dead-lettered, so a
            // run failed its check on a handler that is meant to succeed.
            let roomy = (name == Behaviour::LogFlood.subscriber(0))
                .then_some(std::time::Duration::from_millis(50));
            config.subscribers.push(SubscriberConfig {
                name,
                handler_cpu_budget: roomy,
                ..Default::default()
            });
        }
    }
    if config.defaults.partition_key == PartitionSource::IdempotencyKey {
        config.defaults.partition_key = PartitionSource::JsonPointer {
            pointer: "/order_id".into(),
        };
    }
    config
}

/// What the acker thread counts per subscriber.
#[derive(Default)]
struct Counts {
    processed: u64,
    duplicates: u64,
    dead_lettered: u64,
    other: u64,
    first_reason: Option<String>,
    unexpected_reasons: u64,
    last_outcome: Duration,
}

/// The phase's lanes: the good subscribers, then (`with_hostile`) one of each hostile
/// behaviour.
fn lanes(params: &AdversarialParams, with_hostile: bool) -> Vec<Lane> {
    (0..params.good_subscribers)
        .map(|i| (Behaviour::Good, i))
        .chain(
            Behaviour::HOSTILE
                .iter()
                .filter(|_| with_hostile)
                .map(|b| (*b, 0)),
        )
        .map(|(b, i)| Lane {
            name: b.subscriber(i),
            behaviour: b,
            quota: match b {
                Behaviour::Good => params.messages,
                _ => params.bad_messages,
            },
            sent: 0,
            unique: 0,
        })
        .collect()
}

/// The thread that counts each lane's outcomes (the lane is in the high bits of a seq)
/// and frees its in-flight slots.
fn spawn_acker(
    behaviours: Vec<Behaviour>,
    inflight: Arc<Vec<AtomicU64>>,
    ack_rx: crossbeam_channel::Receiver<Vec<Done>>,
    start: Instant,
) -> Result<std::thread::JoinHandle<Vec<Counts>>, BenchError> {
    std::thread::Builder::new()
        .name("adversarial-acker".into())
        .spawn(move || {
            let mut counts: Vec<Counts> = behaviours.iter().map(|_| Counts::default()).collect();
            for batch in ack_rx {
                let at = start.elapsed();
                for d in batch {
                    let lane = (d.seq >> LANE_SHIFT) as usize;
                    let c = &mut counts[lane];
                    c.last_outcome = at;
                    match d.outcome {
                        Outcome::Processed => c.processed += 1,
                        Outcome::Duplicate => c.duplicates += 1,
                        Outcome::DeadLettered { reason, .. } => {
                            c.dead_lettered += 1;
                            let expected = behaviours[lane].expected_reasons();
                            if !expected.iter().any(|e| reason.contains(e)) {
                                c.unexpected_reasons += 1;
                            }
                            c.first_reason.get_or_insert(reason);
                        }
                        _ => c.other += 1,
                    }
                    inflight[lane].fetch_sub(1, Ordering::AcqRel);
                }
            }
            counts
        })
        .map_err(|e| BenchError::Naive(format!("cannot start the acker: {e}")))
}

fn run_phase(
    params: &AdversarialParams,
    config: &Config,
    factories: &BTreeMap<&'static str, Arc<dyn HandlerFactory>>,
    with_hostile: bool,
) -> Result<PhaseReport, BenchError> {
    let tmp = tempfile::Builder::new()
        .prefix(".dedupd-adversarial-")
        .tempdir_in(&params.dir)
        .map_err(|e| BenchError::Dir(params.dir.clone(), e))?;
    let ledger = Ledger::open(&tmp.path().join("engine"), config, Arc::new(SystemClock))?;
    let mut lanes = lanes(params, with_hostile);
    let subs: Vec<_> = lanes
        .iter()
        .map(|l| ledger.subscriber(&l.name))
        .collect::<Result<_, _>>()?;
    for (lane, sub) in lanes.iter().zip(&subs) {
        let factory = factories.get(lane.behaviour.component()).cloned();
        ledger.set_handler(&sub.name, factory)?;
    }
    let inflight: Arc<Vec<AtomicU64>> = Arc::new(lanes.iter().map(|_| AtomicU64::new(0)).collect());
    let behaviours: Vec<Behaviour> = lanes.iter().map(|l| l.behaviour).collect();
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    let start = Instant::now();
    let acker = spawn_acker(behaviours, inflight.clone(), ack_rx, start)?;
    let driven = drive_lanes(params, &ledger, &subs, &mut lanes, &inflight, ack_tx);
    let elapsed = start.elapsed();
    let counts = acker
        .join()
        .map_err(|_| BenchError::Naive("the acker panicked".into()))?;
    driven?;
    let report = ledger.report()?;
    let mut phase = PhaseReport {
        with_hostile,
        shards: ledger.shard_count(),
        elapsed_s: elapsed.as_secs_f64(),
        ..Default::default()
    };
    for (lane, c) in lanes.iter().zip(counts) {
        let stored = report
            .subscribers
            .iter()
            .find(|s| s.subscriber == lane.name);
        let state = ledger.state_entries(&lane.name)?;
        let calls_deferred = ledger
            .subscriber(&lane.name)?
            .counters
            .handler_calls_deferred
            .load(std::sync::atomic::Ordering::Relaxed);
        check_state(params, lane, &state, &mut phase.problems);
        let tally = Tally {
            subscriber: lane.name.clone(),
            behaviour: Some(lane.behaviour),
            sent: lane.sent,
            unique: lane.unique,
            processed: c.processed,
            duplicates: c.duplicates,
            dead_lettered: c.dead_lettered,
            other: c.other,
            claims: stored.map_or(0, |s| s.claims),
            state_entries: state.len() as u64,
            first_reason: c.first_reason,
            unexpected_reasons: c.unexpected_reasons,
            last_outcome_s: c.last_outcome.as_secs_f64(),
            calls_deferred,
        };
        check_outcomes(&tally, lane.behaviour, &mut phase.problems);
        if lane.behaviour == Behaviour::Good {
            phase.good_messages += tally.sent;
            phase.good_elapsed_s = phase.good_elapsed_s.max(tally.last_outcome_s);
        }
        phase.subscribers.push(tally);
    }
    ledger.close()?;
    phase.good_msgs_per_sec = phase.good_messages as f64 / phase.good_elapsed_s.max(1e-9);
    Ok(phase)
}

/// A job's `seq` holds its lane above this bit and its number in the lane below.
const LANE_SHIFT: u32 = 40;

/// Sends every lane's quota, each lane at most `window` messages ahead of its outcomes, in
/// per-shard chunks; returns once every outcome is in (the acker then ends).
fn drive_lanes(
    params: &AdversarialParams,
    ledger: &Ledger,
    subs: &[Arc<crate::ledger::Subscriber>],
    lanes: &mut [Lane],
    inflight: &[AtomicU64],
    ack_tx: crossbeam_channel::Sender<Vec<Done>>,
) -> Result<(), BenchError> {
    let settings: Vec<_> = subs.iter().map(|s| s.settings()).collect();
    let mut staged: Vec<Vec<Job>> = (0..ledger.shard_count()).map(|_| Vec::new()).collect();
    let window = params.window.max(1);
    loop {
        let mut staged_any = false;
        let mut left = false;
        for (i, lane) in lanes.iter_mut().enumerate() {
            // A few messages per lane per sweep, so lanes interleave within a batch.
            for _ in 0..16 {
                if lane.sent >= lane.quota {
                    break;
                }
                left = true;
                if inflight[i].load(Ordering::Acquire) >= window {
                    break;
                }
                let seq = ((i as u64) << LANE_SHIFT) | lane.sent;
                let (n, _) = lane.next(params.redeliver_every);
                let id = format!("m-{n}");
                let body = payload(n, params.orders);
                let mut job = Job::new(
                    seq,
                    subs[i].id,
                    key_hash(id.as_bytes()),
                    fingerprint(body.as_bytes()),
                    &id,
                    body.as_bytes(),
                    ack_tx.clone(),
                );
                inflight[i].fetch_add(1, Ordering::AcqRel);
                let shard = super::place_event(ledger, &subs[i], &settings[i], &mut job)?;
                staged[shard].push(job);
                staged_any = true;
            }
        }
        for (shard, jobs) in staged.iter_mut().enumerate() {
            if !jobs.is_empty() {
                ledger.submit(shard, std::mem::take(jobs))?;
            }
        }
        if !left {
            break;
        }
        if !staged_any {
            std::thread::sleep(Duration::from_micros(200));
        }
        if let Some(r) = ledger.poison_reason() {
            return Err(LedgerError::Poisoned(r).into());
        }
    }
    while inflight.iter().any(|n| n.load(Ordering::Acquire) > 0) {
        std::thread::sleep(Duration::from_millis(1));
        if let Some(r) = ledger.poison_reason() {
            return Err(LedgerError::Poisoned(r).into());
        }
    }
    Ok(())
}

/// Outcome counts against what the lane's traffic and behaviour must give.
fn check_outcomes(t: &Tally, b: Behaviour, problems: &mut Vec<String>) {
    let mut differ = |what: &str, got: u64, want: u64| {
        if got != want {
            problems.push(format!("{}: {what} {got}, expected {want}", t.subscriber));
        }
    };
    if b.succeeds() {
        differ("processed", t.processed, t.unique);
        differ("duplicates", t.duplicates, t.sent - t.unique);
        differ("dead letters", t.dead_lettered, 0);
        differ("claims", t.claims, t.unique);
    } else {
        // No claim survives a failed attempt, so a redelivery is tried (and fails) again.
        differ("dead letters", t.dead_lettered, t.sent);
        differ("processed", t.processed, 0);
        differ("duplicates", t.duplicates, 0);
        differ("claims", t.claims, 0);
        differ("dead letters with another reason", t.unexpected_reasons, 0);
    }
    differ("other outcomes", t.other, 0);
}

/// A succeeding lane's state is exactly one counter per order, each the number of distinct
/// ids of that order; a failing lane's state is empty.
fn check_state(
    params: &AdversarialParams,
    lane: &Lane,
    state: &[crate::effects::StateEntry],
    problems: &mut Vec<String>,
) {
    let mut want: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
    if lane.behaviour.succeeds() {
        for n in 0..lane.unique {
            let order = format!("o-{}", n % params.orders.max(1));
            let mut key = entity_scope(&order);
            key.extend_from_slice(format!("count/{order}").as_bytes());
            *want.entry(key).or_default() += 1;
        }
    }
    let got: BTreeMap<Vec<u8>, u64> = state
        .iter()
        .map(|(k, v)| {
            let n = std::str::from_utf8(v).ok().and_then(|s| s.parse().ok());
            (k.clone(), n.unwrap_or(u64::MAX))
        })
        .collect();
    if got != want {
        let wrong = want.iter().filter(|(k, v)| got.get(*k) != Some(v)).count()
            + got.keys().filter(|k| !want.contains_key(*k)).count();
        problems.push(format!(
            "{}: {wrong} state entries differ ({} stored, {} expected)",
            lane.name,
            got.len(),
            want.len()
        ));
    }
}

impl std::fmt::Display for AdversarialReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.params;
        writeln!(
            f,
            "adversarial: {} good subscribers x {} msgs, 5 hostile x {} msgs, window {} per subscriber, {} shards",
            p.good_subscribers, p.messages, p.bad_messages, p.window, self.shards
        )?;
        for phase in [&self.baseline, &self.mixed] {
            writeln!(
                f,
                "{:<9} good {:>9.0} msgs/s  ({} good msgs in {:.2} s; phase {:.2} s)",
                if phase.with_hostile {
                    "mixed"
                } else {
                    "baseline"
                },
                phase.good_msgs_per_sec,
                phase.good_messages,
                phase.good_elapsed_s,
                phase.elapsed_s
            )?;
        }
        for t in self
            .mixed
            .subscribers
            .iter()
            .filter(|t| t.behaviour != Some(Behaviour::Good))
        {
            writeln!(
                f,
                "  {:<11} sent {:>6}  processed {:>6}  duplicate {:>5}  dead-lettered {:>6}  claims {:>6}  deferred {:>5}  last outcome {:>6.2} s  {}",
                t.subscriber,
                t.sent,
                t.processed,
                t.duplicates,
                t.dead_lettered,
                t.claims,
                t.calls_deferred,
                t.last_outcome_s,
                t.first_reason.as_deref().unwrap_or("")
            )?;
        }
        writeln!(
            f,
            "ratio    {:.3} (good throughput with the hostile subscribers over without; target >= 0.8); {:.1} ms of the good traffic's time per hostile message",
            self.ratio, self.extra_ms_per_hostile_message
        )?;
        match self.verified() {
            true => writeln!(
                f,
                "verified every outcome, claim and counter exact in both phases"
            ),
            false => {
                for p in self.baseline.problems.iter().chain(&self.mixed.problems) {
                    writeln!(f, "PROBLEM  {p}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run_adversarial` refuses what it cannot use before it loads a component.
    #[test]
    fn run_refuses_bad_parameters_before_it_starts() {
        let tmp = tempfile::tempdir().unwrap();
        let params = AdversarialParams {
            good_subscribers: 0,
            messages: 10,
            bad_messages: 1,
            orders: 1,
            redeliver_every: 0,
            window: 1,
            components: tmp.path().join("nowhere"),
            dir: tmp.path().to_path_buf(),
            config: Config::default(),
        };
        let e = run_adversarial(&params, |_| {}).unwrap_err();
        assert_eq!(
            e.to_string(),
            "good_subscribers (--good-subscribers) must be at least 1, got 0"
        );
    }

    #[test]
    fn lanes_redeliver_only_ids_already_sent() {
        let mut lane = Lane {
            name: "x".into(),
            behaviour: Behaviour::Good,
            quota: 100,
            sent: 0,
            unique: 0,
        };
        let mut seen = std::collections::BTreeSet::new();
        let mut redelivered = 0;
        for _ in 0..100 {
            let (n, again) = lane.next(10);
            assert_eq!(again, seen.contains(&n), "{n}");
            redelivered += u64::from(again);
            seen.insert(n);
        }
        assert_eq!(redelivered, 10);
        assert_eq!(lane.unique, 90);
        assert_eq!(seen.len(), 90);
    }
}
