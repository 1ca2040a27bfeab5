//! The engine part of a run, two threads: the generator submits the traffic, at most a
//! window of messages ahead of the released outcomes (paced with `--rate`), and the acker
//! releases outcomes in source order as a source would, measuring latency, memory and the
//! throughput series.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{place_event, BenchError, Progress, SeriesPoint};
use crate::envelope::{fingerprint, key_hash};
use crate::ledger::{Done, Job, Ledger, LedgerError, Outcome};
use crate::pipeline::Sequencer;
use crate::source::generator::{Event, Expect, Traffic, TrafficSpec};
use crate::telemetry::{rss_bytes, Latency};

pub(super) struct AckerResult {
    pub(super) latency: Latency,
    /// Outcomes released, by kind.
    pub(super) counts: Released,
    /// The highest RSS sampled (every quarter second).
    pub(super) rss_max: u64,
    pub(super) series: Vec<SeriesPoint>,
}

/// Released outcomes, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Released {
    pub(super) processed: u64,
    pub(super) duplicates: u64,
    pub(super) quarantined: u64,
    pub(super) dead_lettered: u64,
    pub(super) rejected: u64,
    pub(super) failed: u64,
}

impl Released {
    fn add(&mut self, kind: Kind) {
        *match kind {
            Kind::Processed => &mut self.processed,
            Kind::Duplicate => &mut self.duplicates,
            Kind::Quarantined => &mut self.quarantined,
            Kind::DeadLettered => &mut self.dead_lettered,
            Kind::Rejected => &mut self.rejected,
            Kind::Failed => &mut self.failed,
        } += 1;
    }

    /// Exactly what the generator expected, and nothing dead-lettered, rejected or failed.
    pub(super) fn matches(&self, expected: &Expected) -> bool {
        (self.processed, self.duplicates, self.quarantined)
            == (expected.new, expected.duplicates, expected.quarantined)
            && self.dead_lettered + self.rejected + self.failed == 0
    }
}

/// An outcome's kind, held by the acker until it is released in order.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Processed,
    Duplicate,
    Quarantined,
    DeadLettered,
    Rejected,
    Failed,
}

/// What the generator knows each message must get.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Expected {
    pub(super) new: u64,
    pub(super) duplicates: u64,
    pub(super) quarantined: u64,
}

/// What the generator and the acker share while the engine runs.
pub(super) struct Live {
    pub(super) start: Instant,
    window: u64,
    /// Nanoseconds between two messages of a paced run (`--rate`).
    ns_per_msg: Option<u64>,
    /// Submission time (µs since `start`) of each message in the window, by `seq % window`.
    submitted_at: Vec<AtomicU64>,
    /// Every message below this seq has its outcome released, in order.
    released: AtomicU64,
    /// The running p99 acknowledgement latency in µs, for the progress line.
    p99_us: AtomicU64,
}

impl Live {
    pub(super) fn new(window: u64, rate: Option<u64>) -> Live {
        Live {
            start: Instant::now(),
            window,
            ns_per_msg: rate.map(|r| 1_000_000_000 / r.max(1)),
            submitted_at: (0..window).map(|_| AtomicU64::new(0)).collect(),
            released: AtomicU64::new(0),
            p99_us: AtomicU64::new(0),
        }
    }
}

/// Releases outcomes in source order as a real source would, measuring each message's
/// latency from submission to release and sampling RSS every quarter second.
pub(super) fn spawn_acker(
    live: Arc<Live>,
    ack_rx: crossbeam_channel::Receiver<Vec<Done>>,
    generator: std::thread::Thread,
    series_step: u64,
    data_dir: std::path::PathBuf,
) -> Result<std::thread::JoinHandle<AckerResult>, BenchError> {
    std::thread::Builder::new()
        .name("bench-acker".into())
        .spawn(move || {
            let mut order: Sequencer<Kind> = Sequencer::starting_at(0);
            let mut r = AckerResult {
                latency: Latency::default(),
                counts: Released::default(),
                rss_max: 0,
                series: Vec::new(),
            };
            let mut last_sample = Instant::now();
            let mut step_start = (0u64, Duration::ZERO);
            for batch in ack_rx {
                for d in batch {
                    let kind = match d.outcome {
                        Outcome::Processed => Kind::Processed,
                        Outcome::Duplicate => Kind::Duplicate,
                        Outcome::Quarantined { .. } => Kind::Quarantined,
                        Outcome::DeadLettered { .. } => Kind::DeadLettered,
                        Outcome::Rejected { .. } => Kind::Rejected,
                        Outcome::Failed { .. } => Kind::Failed,
                    };
                    order.insert(d.seq, kind);
                }
                let now = live.start.elapsed().as_micros() as u64;
                while let Some((seq, kind)) = order.pop_ready() {
                    let t = live.submitted_at[(seq % live.window) as usize].load(Ordering::Acquire);
                    r.latency.record_us(now.saturating_sub(t));
                    r.counts.add(kind);
                }
                if last_sample.elapsed() >= Duration::from_millis(250) {
                    last_sample = Instant::now();
                    r.rss_max = r.rss_max.max(rss_bytes());
                }
                let released = order.watermark();
                if released >= step_start.0 + series_step {
                    let at = live.start.elapsed();
                    let secs = (at - step_start.1).as_secs_f64().max(1e-9);
                    r.series.push(SeriesPoint {
                        messages: released,
                        msgs_per_sec: (released - step_start.0) as f64 / secs,
                        processed: r.counts.processed,
                        rss_bytes: rss_bytes(),
                        disk_allocated_bytes: crate::ledger::dir_allocated_bytes(&data_dir),
                    });
                    step_start = (released, at);
                }
                live.released.store(released, Ordering::Release);
                if r.latency.count().is_multiple_of(64) {
                    let p99 = (r.latency.quantile_ms(0.99) * 1000.0) as u64;
                    live.p99_us.store(p99, Ordering::Relaxed);
                }
                generator.unpark();
            }
            r
        })
        .map_err(|e| BenchError::Naive(format!("cannot start acker: {e}")))
}

/// What the generator submitted.
pub(super) struct Driven {
    /// Messages submitted (all released when `drive` returns).
    pub(super) messages: u64,
    /// What the generator knows each message must get.
    pub(super) expected: Expected,
}

/// Generates the traffic and submits it, at most `window` messages ahead of the released
/// outcomes, in per-shard chunks; returns once every outcome is released.
pub(super) fn drive(
    ledger: &Ledger,
    subs: &[Arc<crate::ledger::Subscriber>],
    spec: TrafficSpec,
    live: &Live,
    ack_tx: crossbeam_channel::Sender<Vec<Done>>,
    progress: &mut impl FnMut(Progress),
) -> Result<Driven, BenchError> {
    let settings: Vec<_> = subs.iter().map(|s| s.settings()).collect();
    let mut traffic = Traffic::new(spec);
    let mut ev = Event::default();
    let mut staged: Vec<Vec<Job>> = (0..ledger.shard_count()).map(|_| Vec::new()).collect();
    let mut expected = Expected::default();
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
    let pace = live.ns_per_msg;
    while traffic.next_into(&mut ev) {
        // Paced: sleep until this message is due when that is more than PACE_SLACK_US
        // away, handing over what is staged first (a chunk must not hold back messages
        // that are due). Closer than that it goes at once, up to that much early: a
        // generator that spun until each message was due kept a core busy, which on two
        // cores took it from the shards (p99 139 ms at half the claim-only capacity).
        let due_us = pace.map(|ns_per_msg| seq * ns_per_msg / 1000);
        if let Some(due) = due_us {
            let now = live.start.elapsed().as_micros() as u64;
            if due > now + PACE_SLACK_US {
                flush(&mut staged)?;
                std::thread::sleep(Duration::from_micros(due - now));
            }
        }
        while seq - live.released.load(Ordering::Acquire) >= live.window {
            flush(&mut staged)?;
            std::thread::park_timeout(Duration::from_micros(500));
            if let Some(r) = ledger.poison_reason() {
                return Err(LedgerError::Poisoned(r).into());
            }
        }
        match ev.expect {
            Some(Expect::New) => expected.new += 1,
            Some(Expect::Duplicate) => expected.duplicates += 1,
            _ => expected.quarantined += 1,
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
        // Paced, latency counts from when the message was due, however late it was sent.
        let submitted = due_us.unwrap_or_else(|| live.start.elapsed().as_micros() as u64);
        live.submitted_at[(seq % live.window) as usize].store(submitted, Ordering::Release);
        let shard = place_event(ledger, sub, &settings[ev.subscriber as usize], &mut job)?;
        staged[shard].push(job);
        if staged[shard].len() >= 256 {
            ledger.submit(shard, std::mem::take(&mut staged[shard]))?;
        }
        seq += 1;
        if seq.is_multiple_of(8192) && last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            progress(Progress {
                phase: "engine",
                done: live.released.load(Ordering::Relaxed),
                total: spec.messages,
                elapsed: live.start.elapsed(),
                p99_ms: live.p99_us.load(Ordering::Relaxed) as f64 / 1000.0,
            });
        }
    }
    flush(&mut staged)?;
    while live.released.load(Ordering::Acquire) < seq {
        std::thread::park_timeout(Duration::from_millis(1));
        if let Some(r) = ledger.poison_reason() {
            return Err(LedgerError::Poisoned(r).into());
        }
    }
    Ok(Driven {
        messages: seq,
        expected,
    })
}

/// How early a paced message may go rather than the generator sleeping until it is due.
const PACE_SLACK_US: u64 = 200;

#[cfg(test)]
mod tests {
    use super::*;

    /// `verified` in the report: exactly the expected outcomes, and nothing else.
    #[test]
    fn released_outcomes_match_only_exactly_what_was_expected() {
        let expected = Expected {
            new: 2,
            duplicates: 1,
            quarantined: 0,
        };
        let mut r = Released::default();
        for kind in [Kind::Processed, Kind::Duplicate, Kind::Processed] {
            r.add(kind);
        }
        assert!(r.matches(&expected));
        let mut extra = r;
        extra.add(Kind::DeadLettered);
        assert!(!extra.matches(&expected), "a dead letter is not expected");
        let mut swapped = Released::default();
        for kind in [Kind::Processed, Kind::Duplicate, Kind::Quarantined] {
            swapped.add(kind);
        }
        assert!(
            !swapped.matches(&expected),
            "a quarantine in place of a new message"
        );
    }
}
