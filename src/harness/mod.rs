//! `dedupd handler test`: runs a handler component over messages given as JSON lines and
//! reports, per message, what the engine decided and what the handler did.
//!
//! Nothing of the engine is re-implemented here. Each line goes through the step every
//! source shares ([`route`]: canonical payload, idempotency key, fingerprint, entity),
//! is decided by a real [`Ledger`] on a temporary data directory (claims, duplicates,
//! quarantine, retries, dead letters), and the handler runs in the engine's host with the
//! subscriber's limits, reading state through the engine's own batch view
//! (read-your-writes, entity scopes, unique marks, versions). `--state` seeds that ledger
//! through the same commit path a handler's writes take. What differs from a production
//! run, so that a test is fast and its output reproducible:
//!
//! - one shard, on a temporary directory removed at the end;
//! - time stands still at [`Options::now_ms`]: every message is received then (its
//!   `received-at`, `now-ms`), and no claim expires;
//! - a retryable failure is retried at once, without the backoff;
//! - messages are decided one at a time, each in a batch of its own (a handler reads the
//!   same state either way: the batch view layers earlier messages' writes);
//! - a handler's log lines and printed output are captured (not rate-limited) instead of
//!   going to the engine's log;
//! - the outbox is not relayed: emitted messages are reported.
//!
//! Where things are:
//!
//! - `mod.rs`: what a run takes ([`Options`]) and why it may fail ([`HarnessError`]);
//! - `input.rs`: the test files read, every line checked and numbered: messages
//!   ([`read_messages`]) and the initial state ([`read_state`]);
//! - `run.rs`: the run ([`run()`]): the test config, the temporary ledger, the component
//!   wrapped to record its calls, the seeded state, one report per message;
//! - `report.rs`: what a run reports (`Report` and its parts) and how it is printed
//!   ([`json_lines`], [`write_human`]);
//! - `compare.rs`: the reports against an expected `--json` output ([`compare()`]).
//!
//! [`route`]: crate::source::delivery::route
//! [`Ledger`]: crate::ledger::Ledger

mod compare;
mod input;
mod report;
mod run;

pub use compare::compare;
pub(crate) use input::SeedEntry;
pub use input::SeedLine;
pub use input::{parse_state, read_messages, read_state, Messages, Seed};
pub use report::{json_lines, write_human, VersionSet};
pub use run::run;

use std::path::PathBuf;
use std::time::Duration;

use crate::config::Config;
use crate::handler::HandlerError;
use crate::ledger::LedgerError;

/// The time every message is received at unless told otherwise: 2023-11-14T22:13:20Z.
pub const DEFAULT_NOW_MS: u64 = 1_700_000_000_000;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The component under test.
    pub component: PathBuf,
    /// The subscriber's settings come from here (key source, partition key, fingerprint,
    /// limits, attempts); its `handler` paths are ignored.
    pub config: Config,
    /// The subscriber to run as (default: the config's `default_subscriber`). Must be a
    /// `[[subscriber]]` of the config when given.
    pub subscriber: Option<String>,
    /// The engine's time for the whole run, ms since the epoch.
    pub now_ms: u64,
    /// Replaces the subscriber's `handler_cpu_budget` (slow CI machines).
    pub cpu_budget: Option<Duration>,
}

/// Why a run could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HarnessError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A line of an input or state file is unusable.
    #[error("{file}:{line}: {reason}")]
    Line {
        file: String,
        line: usize,
        reason: String,
    },
    #[error(transparent)]
    Handler(#[from] HandlerError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("{0}")]
    Setup(String),
}
