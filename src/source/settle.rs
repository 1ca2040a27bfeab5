//! What the NATS, MQTT and RabbitMQ sources share between handing jobs to the shards and
//! the broker's acknowledgement (G1): the submission of staged jobs, the thread that
//! carries outcomes from the shard threads to a source's async loop, the counting of a
//! durable outcome (and whether it is acknowledged or refused), and the dead-letter record
//! kept of input that cannot be keyed before the broker hears of it. How each broker is told (`Ack`/`Term`, PUBACK,
//! `basic.ack`/`basic.reject`) and when (each message, arrival order, `multiple` runs)
//! stays with its source.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

use crate::ledger::{Done, Job, Ledger, LedgerError, Outcome, StoredPayload};

/// Why the ledger did not take (or finish) a source's work: nothing more is acknowledged
/// (G7). Each source stops with it as its `Ledger` error.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LedgerFailure {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// A job's outcome: failed, for the reason the ledger gave it.
    #[error("{reason}")]
    Failed { reason: String },
    /// The blocking task writing a dead-letter record panicked or was cancelled.
    #[error("dead-letter write panicked: {0}")]
    Panicked(#[source] tokio::task::JoinError),
}

/// Submits the jobs staged per shard (`staged[shard]`), leaving every list empty. An error
/// is the ledger's.
pub(crate) fn submit_staged(ledger: &Ledger, staged: &mut [Vec<Job>]) -> Result<(), LedgerFailure> {
    for (shard, jobs) in staged.iter_mut().enumerate() {
        if !jobs.is_empty() {
            ledger.submit(shard, std::mem::take(jobs))?;
        }
    }
    Ok(())
}

/// Outcomes arrive on a crossbeam channel from the shard threads; a thread named `thread`
/// hands them to the async loop. It ends when every job (each holds a sender) and the
/// receiver are gone.
pub(crate) fn bridge_dones(
    thread: String,
) -> (
    crossbeam_channel::Sender<Vec<Done>>,
    mpsc::UnboundedReceiver<Vec<Done>>,
) {
    let (ack_tx, ack_rx) = crossbeam_channel::unbounded::<Vec<Done>>();
    // Unbounded, but never longer than the in-flight window: one `Done` per message held.
    let (tx, rx) = mpsc::unbounded_channel();
    let spawned = std::thread::Builder::new()
        .name(thread.clone())
        .spawn(move || {
            for dones in ack_rx {
                if tx.send(dones).is_err() {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        // Without the thread no outcome arrives and nothing is acknowledged: G1 holds, and
        // the drain at stop gives the messages back (or leaves them to the session).
        tracing::error!("cannot start the ack thread {thread}: {e}");
    }
    (ack_tx, rx)
}

/// The wall clock in milliseconds since the epoch: when a delivery was received.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A metrics counter looked up on first use and kept: a source counts every message, and
/// `metrics::counter!` with a label allocates the label's text and looks the series up in
/// the recorder each time. Resolved lazily, so `/metrics` shows a series only once it has
/// counted something, as before. A `OnceLock`, not a `OnceCell`: a source's state is held
/// across awaits by tasks that may move between threads.
#[derive(Default)]
pub(crate) struct Meter(std::sync::OnceLock<metrics::Counter>);

impl Meter {
    /// The counter, resolved by `resolve` the first time.
    pub(crate) fn get(&self, resolve: impl FnOnce() -> metrics::Counter) -> &metrics::Counter {
        self.0.get_or_init(resolve)
    }
}

/// The names [`OutcomeStats::count`] gives outcomes (the `outcome` label).
const OUTCOME_NAMES: [&str; 5] = [
    "processed",
    "duplicate",
    "quarantined",
    "dead_lettered",
    "rejected",
];

/// A subscriber's counters of the source's messages metric, one per outcome label.
#[derive(Default)]
pub(crate) struct OutcomeMeters([Meter; 5]);

impl OutcomeMeters {
    /// Adds `n` to the counter of `outcome`, resolved by `resolve` (given the label) the
    /// first time.
    pub(crate) fn increment(
        &self,
        outcome: &'static str,
        n: u64,
        resolve: impl FnOnce(&'static str) -> metrics::Counter,
    ) {
        match OUTCOME_NAMES.iter().position(|o| *o == outcome) {
            Some(i) => self.0[i].get(|| resolve(outcome)).increment(n),
            None => resolve(outcome).increment(n),
        }
    }
}

/// How the broker is told of a durable outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settle {
    /// `processed`, `duplicate`, `quarantined`: acknowledged.
    Ack,
    /// `dead_lettered`, `rejected` (kept in the ledger's dead letters): refused where the
    /// broker can be told (NATS `Term`, RabbitMQ `basic.reject`); MQTT acknowledges them.
    Refuse,
}

/// A binding's counts of durable outcomes.
#[derive(Debug, Default)]
pub(crate) struct OutcomeStats {
    pub(crate) processed: AtomicU64,
    pub(crate) duplicate: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) rejected: AtomicU64,
}

impl OutcomeStats {
    /// Counts a durable outcome; returns its name (the `outcome` label of the source's
    /// messages metric) and how it is settled. A `Failed` outcome is counted nowhere and
    /// its reason returned: the ledger failed and nothing more is acknowledged (G7).
    pub(crate) fn count(&self, outcome: &Outcome) -> Result<(&'static str, Settle), LedgerFailure> {
        let (counter, name, settle) = match outcome {
            Outcome::Processed => (&self.processed, "processed", Settle::Ack),
            Outcome::Duplicate => (&self.duplicate, "duplicate", Settle::Ack),
            Outcome::Quarantined { .. } => (&self.quarantined, "quarantined", Settle::Ack),
            Outcome::DeadLettered { .. } => (&self.dead_lettered, "dead_lettered", Settle::Refuse),
            Outcome::Rejected { .. } => (&self.rejected, "rejected", Settle::Refuse),
            Outcome::Failed { reason } => {
                return Err(LedgerFailure::Failed {
                    reason: reason.clone(),
                })
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok((name, settle))
    }
}

/// Writes the durable dead-letter record of input that cannot be keyed for `subscriber`
/// (`reason`, then the fields of `about` — `origin`, `id`, `key`, `headers`, as the source
/// has them — then `payload` as records keep it: text when it is UTF-8, else base64) and
/// counts it `rejected` in `stats`. Only then may the broker be told (G1: never a
/// settlement for a message whose record is not durable). An error is the ledger's.
pub(crate) async fn keep_dead_letter(
    ledger: &Arc<Ledger>,
    subscriber: &str,
    stats: &OutcomeStats,
    reason: String,
    about: serde_json::Value,
    payload: &[u8],
) -> Result<(), LedgerFailure> {
    let mut record = serde_json::json!({
        "reason": reason,
        "attempts": 0,
    });
    if let Some(o) = record.as_object_mut() {
        if let serde_json::Value::Object(fields) = about {
            o.extend(fields);
        }
        if let Ok(serde_json::Value::Object(p)) = serde_json::to_value(StoredPayload::of(payload)) {
            o.extend(p);
        }
    }
    let (ledger, name) = (ledger.clone(), subscriber.to_string());
    tokio::task::spawn_blocking(move || ledger.add_dead_letter(&name, record))
        .await
        .map_err(LedgerFailure::Panicked)??;
    stats.rejected.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use super::*;

    #[test]
    fn every_counted_outcome_has_a_meter_of_its_own() {
        let stats = OutcomeStats::default();
        let outcomes = [
            Outcome::Processed,
            Outcome::Duplicate,
            Outcome::Quarantined {
                stored_fingerprint: 0,
            },
            Outcome::DeadLettered {
                reason: String::new(),
                attempts: 1,
            },
            Outcome::Rejected {
                reason: String::new(),
            },
        ];
        let names: Vec<&str> = outcomes.iter().map(|o| stats.count(o).unwrap().0).collect();
        assert_eq!(names, OUTCOME_NAMES);
    }
}
