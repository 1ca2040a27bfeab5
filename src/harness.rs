//! `dedupd handler test`: runs a handler component over messages given as JSON lines and
//! reports, per message, what the engine decided and what the handler did.
//!
//! Nothing of the engine is re-implemented here. Each line goes through the step every
//! source shares ([`envelope`]: canonical payload, idempotency key, fingerprint, entity),
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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use crate::clock::ManualClock;
use crate::config::{Config, PartitionSource, SubscriberConfig};
use crate::effects::{
    unique_key, Effects, Failure, HandlerFactory, HandlerMessage, MessageHandler, StateReader,
};
use crate::envelope::{key_hash, Envelope};
use crate::handler::{CallTrace, Component, GuardCall, HandlerError, WasmHandler};
use crate::inspect::readable;
use crate::ledger::{Job, Ledger, LedgerError, Outcome};
use crate::source::delivery::{envelope, Delivery, EnvelopeError, Keying, Payload, Target};

/// The time every message is received at unless told otherwise: 2023-11-14T22:13:20Z.
pub const DEFAULT_NOW_MS: u64 = 1_700_000_000_000;

/// How long one message may take to be decided before the run is given up.
const DECIDE_TIMEOUT: Duration = Duration::from_secs(120);

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

/// The messages of an input file.
#[derive(Debug, Clone, Default)]
pub struct Messages {
    /// The file's name, for errors.
    pub file: String,
    pub lines: Vec<InputLine>,
}

/// The entries of a state file.
#[derive(Debug, Clone, Default)]
pub struct Seed {
    /// The file's name, for errors.
    pub file: String,
    pub lines: Vec<SeedLine>,
}

/// One message of the input: its line number and envelope (a `dedupd pipe` line).
#[derive(Debug, Clone)]
pub struct InputLine {
    pub line: usize,
    pub envelope: Envelope,
}

/// One entry of the initial state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeedEntry {
    /// A state entry, as `dedupd state dump` prints it.
    State { key: Vec<u8>, value: Vec<u8> },
    /// An `insert-unique` mark.
    Unique { namespace: String, key: String },
    /// An `advance-version` version.
    Version { key: String, version: u64 },
}

/// A seed entry and the entity whose store it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedLine {
    pub line: usize,
    pub entity: Option<String>,
    pub entry: SeedEntry,
}

fn read_text(path: &Path) -> Result<String, HarnessError> {
    std::fs::read_to_string(path).map_err(|source| HarnessError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A JSON error without serde's "at line 1 column N" (the line is the file's), with the
/// column kept.
fn json_reason(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&suffix) {
        Some(t) if e.column() > 0 => format!("{t} (column {})", e.column()),
        Some(t) => t.to_string(),
        None => text,
    }
}

/// The non-blank lines of a file with their numbers (from 1).
fn numbered(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty())
}

/// Reads messages: one `dedupd pipe` line each (`{"id":..., "key":..., "headers":{...},
/// "payload":...}`; `subscriber` may name the subscriber under test). Blank lines are
/// skipped; a line that is not such an object is an error naming its number.
pub fn read_messages(path: &Path) -> Result<Messages, HarnessError> {
    let text = read_text(path)?;
    parse_messages(&path.display().to_string(), &text)
}

/// [`read_messages`] over text; `file` names it in errors.
pub fn parse_messages(file: &str, text: &str) -> Result<Messages, HarnessError> {
    let lines = numbered(text)
        .map(|(line, l)| match serde_json::from_str::<Envelope>(l) {
            Ok(envelope) => Ok(InputLine { line, envelope }),
            Err(e) => Err(HarnessError::Line {
                file: file.to_string(),
                line,
                reason: format!("not a message: {}", json_reason(&e)),
            }),
        })
        .collect::<Result<_, _>>()?;
    Ok(Messages {
        file: file.to_string(),
        lines,
    })
}

/// Reads the initial state: JSON lines as `dedupd state dump` prints them,
/// `{"key": K, "value": V}` (with `"entity": E` under a partition key), plus
/// `{"unique": {"namespace": N, "key": K}}` for a mark and
/// `{"version": {"key": K, "version": N}}` for a version, each with an optional `entity`.
/// Keys and values are bytes written as `state dump` shows them: a JSON string is its
/// UTF-8 text, `{"hex": "..."}` is those bytes, any other JSON value is its compact text.
pub fn read_state(path: &Path) -> Result<Seed, HarnessError> {
    let text = read_text(path)?;
    parse_state(&path.display().to_string(), &text)
}

/// [`read_state`] over text; `file` names it in errors.
pub fn parse_state(file: &str, text: &str) -> Result<Seed, HarnessError> {
    let lines = numbered(text)
        .map(|(line, l)| match seed_line(l) {
            Ok((entity, entry)) => Ok(SeedLine {
                line,
                entity,
                entry,
            }),
            Err(reason) => Err(HarnessError::Line {
                file: file.to_string(),
                line,
                reason,
            }),
        })
        .collect::<Result<_, _>>()?;
    Ok(Seed {
        file: file.to_string(),
        lines,
    })
}

fn seed_line(text: &str) -> Result<(Option<String>, SeedEntry), String> {
    let value: Value = serde_json::from_str(text).map_err(|e| json_reason(&e))?;
    let Value::Object(mut obj) = value else {
        return Err("expected a JSON object".into());
    };
    let entity = match obj.remove("entity") {
        None => None,
        Some(Value::String(e)) if !e.is_empty() && !e.contains('\0') => Some(e),
        Some(_) => return Err("`entity` must be a non-empty string without NUL".into()),
    };
    let entry = if let Some(u) = obj.remove("unique") {
        let (namespace, key) = match &u {
            Value::Object(m) if m.len() == 2 => (
                m.get("namespace").and_then(Value::as_str),
                m.get("key").and_then(Value::as_str),
            ),
            _ => (None, None),
        };
        match (namespace, key) {
            (Some(n), Some(k)) if !n.is_empty() && !n.contains('\0') => SeedEntry::Unique {
                namespace: n.into(),
                key: k.into(),
            },
            _ => return Err(
                "`unique` must be {\"namespace\": \"...\", \"key\": \"...\"} (namespace non-empty, without NUL)".into(),
            ),
        }
    } else if let Some(v) = obj.remove("version") {
        let (key, version) = match &v {
            Value::Object(m) if m.len() == 2 => (
                m.get("key").and_then(Value::as_str),
                m.get("version").and_then(Value::as_u64),
            ),
            _ => (None, None),
        };
        match (key, version) {
            (Some(k), Some(n)) if !k.is_empty() => SeedEntry::Version {
                key: k.into(),
                version: n,
            },
            _ => {
                return Err(
                    "`version` must be {\"key\": \"...\", \"version\": N} (key non-empty, N an unsigned integer)"
                        .into(),
                )
            }
        }
    } else {
        match (obj.remove("key"), obj.remove("value")) {
            (Some(k), Some(v)) => {
                let key = bytes_of(&k).map_err(|e| format!("`key`: {e}"))?;
                if key.is_empty() {
                    return Err("`key` is empty".into());
                }
                SeedEntry::State {
                    key,
                    value: bytes_of(&v).map_err(|e| format!("`value`: {e}"))?,
                }
            }
            _ => return Err(
                "expected {\"key\": ..., \"value\": ...} (as `dedupd state dump` prints), {\"unique\": ...} or {\"version\": ...}"
                    .into(),
            ),
        }
    };
    if let Some(field) = obj.keys().next() {
        return Err(format!("unknown field `{field}`"));
    }
    Ok((entity, entry))
}

/// The bytes a key or value of `state dump` stands for (the inverse of [`readable`]).
fn bytes_of(v: &Value) -> Result<Vec<u8>, String> {
    match v {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Object(m) if m.len() == 1 && m.contains_key("hex") => {
            let hex = m["hex"].as_str().ok_or("`hex` must be a string")?;
            if hex.len() % 2 != 0 {
                return Err("`hex` must have an even number of digits".into());
            }
            (0..hex.len())
                .step_by(2)
                .map(|i| {
                    u8::from_str_radix(&hex[i..i + 2], 16)
                        .map_err(|_| format!("`hex` is not hexadecimal: {hex:?}"))
                })
                .collect()
        }
        other => Ok(serde_json::to_vec(other).unwrap_or_default()),
    }
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Its line in the input file.
    pub line: usize,
    /// The idempotency key's text (absent when none could be derived).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The entity whose state the handler saw (with a partition key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entity: Option<String>,
    /// `processed`, `duplicate`, `quarantined`, `dead_lettered` or `rejected`.
    pub outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// State writes committed with the claim, in key order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub state: Vec<StateWrite>,
    /// Uniqueness marks committed with the claim.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub uniques: Vec<UniqueMark>,
    /// Versions committed with the claim.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<VersionSet>,
    /// Outbox messages committed with the claim (relayed to Kafka by the engine).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub emitted: Vec<Emitted>,
    /// Every handler call, retries included; none for a duplicate or quarantined message.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<CallReport>,
}

/// A state write: `value`, or `deleted`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StateWrite {
    pub key: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<Value>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub deleted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UniqueMark {
    pub namespace: String,
    pub key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionSet {
    pub key: String,
    pub version: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Emitted {
    /// Derived from the message id and the emit's position: the same on every retry.
    pub id: String,
    pub topic: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<(String, String)>,
    pub payload: Value,
}

/// One handler call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallReport {
    /// 1 on the first attempt.
    pub attempt: u32,
    /// `ok`, or the failure's kind: `retryable`, `permanent`, `timeout`, `memory`, `trap`.
    pub result: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Guard calls and their answers, in call order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub guards: Vec<Guard>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logs: Vec<LogLine>,
    /// Log lines over the per-call limit (20), dropped as the engine drops them.
    #[serde(skip_serializing_if = "is_zero")]
    pub dropped_logs: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A guard call and its answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum Guard {
    InsertUnique {
        namespace: String,
        key: String,
        inserted: bool,
    },
    AdvanceVersion {
        key: String,
        version: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        current: Option<u64>,
        advanced: bool,
    },
    CompareAndSet {
        key: Value,
        swapped: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogLine {
    pub level: &'static str,
    pub text: String,
}

/// One recorded handler call.
#[derive(Debug)]
struct Recorded {
    attempt: u32,
    result: Result<Effects, Failure>,
    trace: CallTrace,
}

type Calls = Arc<Mutex<Vec<Recorded>>>;

/// The component under test, recording every call the ledger makes.
#[derive(Debug)]
struct Recorder {
    component: Component,
    calls: Calls,
}

impl HandlerFactory for Recorder {
    fn instantiate(&self) -> Result<Box<dyn MessageHandler>, String> {
        let mut inner = self.component.live_handler().map_err(|e| e.to_string())?;
        inner.record_calls();
        Ok(Box::new(Recording {
            inner,
            calls: self.calls.clone(),
        }))
    }

    fn version(&self) -> u64 {
        HandlerFactory::version(&self.component)
    }
}

struct Recording {
    inner: WasmHandler,
    calls: Calls,
}

impl MessageHandler for Recording {
    fn handle(
        &mut self,
        msg: &HandlerMessage,
        state: Box<dyn StateReader>,
    ) -> (Box<dyn StateReader>, Result<Effects, Failure>) {
        let (state, result) = self.inner.handle(msg, state);
        let trace = self.inner.take_trace().unwrap_or_default();
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Recorded {
                attempt: msg.attempt,
                result: result.clone(),
                trace,
            });
        (state, result)
    }
}

/// Writes the initial state: a stand-in handler returns each entity's entries as its
/// effects, so they are committed (and scoped to their entity) as a handler's writes are.
#[derive(Debug)]
struct Seeder {
    by_id: BTreeMap<String, Effects>,
}

impl HandlerFactory for Seeder {
    fn instantiate(&self) -> Result<Box<dyn MessageHandler>, String> {
        Ok(Box::new(Seeding(self.by_id.clone())))
    }

    fn version(&self) -> u64 {
        0
    }
}

struct Seeding(BTreeMap<String, Effects>);

impl MessageHandler for Seeding {
    fn handle(
        &mut self,
        msg: &HandlerMessage,
        state: Box<dyn StateReader>,
    ) -> (Box<dyn StateReader>, Result<Effects, Failure>) {
        let effects = self.0.get(&msg.id).cloned().unwrap_or_default();
        (state, Ok(effects))
    }
}

/// The config a run uses: the user's, with one shard, no sources, no handler paths, and
/// the tested subscriber retried at once (and with `cpu_budget` if given).
fn test_config(opts: &Options) -> Result<(Config, String), HarnessError> {
    let mut config = opts.config.clone();
    let name = match &opts.subscriber {
        Some(name) => {
            if !config.subscribers.iter().any(|s| &s.name == name) {
                return Err(HarnessError::Setup(format!(
                    "the config has no [[subscriber]] named {name:?}"
                )));
            }
            name.clone()
        }
        None => config.default_subscriber.clone(),
    };
    config.data_dir = None;
    config.ledger.shards = std::num::NonZeroUsize::new(1);
    config.http = None;
    config.kafka = None;
    config.defaults.handler = None;
    if !config.subscribers.iter().any(|s| s.name == name) {
        config.subscribers.push(SubscriberConfig {
            name: name.clone(),
            ..SubscriberConfig::default()
        });
    }
    for s in &mut config.subscribers {
        s.handler = None;
        if s.name == name {
            s.retry_backoff = Some(Duration::ZERO);
            s.max_backoff = Some(Duration::ZERO);
            // Every message is tried on its own: a run of failing test messages must not
            // turn the rest into "circuit open" dead letters.
            s.handler_breaker_failures = Some(0);
            if let Some(budget) = opts.cpu_budget {
                s.handler_cpu_budget = Some(budget);
            }
        }
    }
    Ok((config, name))
}

/// Runs the component over `messages` after seeding `seed`; one report per message, in
/// input order. Deterministic: the same inputs give the same reports.
pub fn run(opts: &Options, messages: &Messages, seed: &Seed) -> Result<Vec<Report>, HarnessError> {
    let (config, name) = test_config(opts)?;
    let settings = config
        .settings_for(&name)
        .ok_or_else(|| HarnessError::Setup(format!("no settings for subscriber {name:?}")))?;
    let component = Component::load(&opts.component, crate::pipeline::limits_of(&settings))?;
    let dir = tempfile::Builder::new()
        .prefix("dedupd-handler-test-")
        .tempdir()
        .map_err(|e| HarnessError::Setup(format!("cannot create a temporary directory: {e}")))?;
    let ledger = Ledger::open(dir.path(), &config, Arc::new(ManualClock::new(opts.now_ms)))?;
    let result = run_on(&ledger, component, &name, messages, seed);
    let closed = ledger.close();
    let reports = result?;
    closed?;
    Ok(reports)
}

/// Waits for the one outcome of a submitted job.
fn decided(
    rx: &crossbeam_channel::Receiver<Vec<crate::ledger::Done>>,
) -> Result<Outcome, HarnessError> {
    match rx.recv_timeout(DECIDE_TIMEOUT) {
        Ok(mut done) if done.len() == 1 => Ok(done.remove(0).outcome),
        Ok(done) => Err(HarnessError::Setup(format!(
            "expected one outcome, got {}",
            done.len()
        ))),
        Err(_) => Err(HarnessError::Setup(format!(
            "no outcome within {DECIDE_TIMEOUT:?}"
        ))),
    }
}

fn run_on(
    ledger: &Ledger,
    component: Component,
    name: &str,
    messages: &Messages,
    seed: &Seed,
) -> Result<Vec<Report>, HarnessError> {
    let sub = ledger.subscriber(name)?;
    let (ack, acks) = crossbeam_channel::unbounded();
    if !seed.lines.is_empty() {
        seed_state(ledger, name, seed, &ack, &acks)?;
    }
    let calls: Calls = Arc::default();
    ledger.set_handler(
        name,
        Some(Arc::new(Recorder {
            component,
            calls: calls.clone(),
        })),
    )?;
    let mut reports = Vec::with_capacity(messages.lines.len());
    for input in &messages.lines {
        if let Some(other) = input.envelope.subscriber.as_deref().filter(|s| *s != name) {
            return Err(HarnessError::Line {
                file: messages.file.clone(),
                line: input.line,
                reason: format!(
                    "the message is for subscriber {other:?}, the test runs {name:?} (--subscriber)"
                ),
            });
        }
        let env = input.envelope.clone();
        let delivery = Delivery {
            id: env.id.clone(),
            key: env.key,
            headers: env.headers.into_iter().collect(),
            ..Delivery::new(Target::Resolved(sub.clone()), Payload::Json(env.payload))
        };
        let mut report = Report {
            line: input.line,
            id: None,
            entity: None,
            outcome: "rejected",
            reason: None,
            state: Vec::new(),
            uniques: Vec::new(),
            versions: Vec::new(),
            emitted: Vec::new(),
            calls: Vec::new(),
        };
        match envelope(ledger, delivery, Keying::Derive, ack.clone()) {
            Ok(mut routed) => {
                routed.job.seq = input.line as u64;
                report.id = Some(routed.job.id.to_string());
                report.entity = routed.job.entity.as_deref().map(str::to_string);
                ledger.submit(routed.shard, vec![routed.job])?;
                let outcome = decided(&acks)?;
                report.outcome = outcome.name();
                report.reason = outcome.reason();
                let recorded =
                    std::mem::take(&mut *calls.lock().unwrap_or_else(|p| p.into_inner()));
                fill(&mut report, recorded, &outcome);
            }
            Err(e) => {
                // As pipe mode answers: the derived key when only the entity failed.
                report.id = match &e {
                    EnvelopeError::Entity { key, .. } => Some(key.text.clone()),
                    _ => env.id,
                };
                report.reason = Some(e.to_string());
            }
        }
        reports.push(report);
    }
    Ok(reports)
}

/// Commits the seed entries, one stand-in message per entity.
fn seed_state(
    ledger: &Ledger,
    name: &str,
    seed: &Seed,
    ack: &crate::ledger::AckSender,
    acks: &crossbeam_channel::Receiver<Vec<crate::ledger::Done>>,
) -> Result<(), HarnessError> {
    let sub = ledger.subscriber(name)?;
    let scoped = sub.settings().partition_key != PartitionSource::IdempotencyKey;
    let mut by_entity: BTreeMap<Option<String>, Effects> = BTreeMap::new();
    for s in &seed.lines {
        if s.entity.is_some() != scoped {
            let reason = match scoped {
                true => format!("subscriber {name:?} has a partition_key, so its state is kept per entity: give the entry an `entity`"),
                false => format!("subscriber {name:?} has no partition_key, so its state has no entities: remove `entity`"),
            };
            return Err(HarnessError::Line {
                file: seed.file.clone(),
                line: s.line,
                reason,
            });
        }
        let effects = by_entity.entry(s.entity.clone()).or_default();
        match &s.entry {
            SeedEntry::State { key, value } => {
                effects.state.insert(key.clone(), Some(value.clone()));
            }
            SeedEntry::Unique { namespace, key } => {
                effects.uniques.insert(unique_key(namespace, key));
            }
            SeedEntry::Version { key, version } => {
                effects.versions.insert(key.clone(), *version);
            }
        }
    }
    let ids: Vec<(String, Option<String>)> = by_entity
        .keys()
        .enumerate()
        .map(|(i, e)| (format!("dedupd-handler-test-seed-{i}"), e.clone()))
        .collect();
    let by_id = ids
        .iter()
        .map(|(id, e)| (id.clone(), by_entity.remove(e).unwrap_or_default()))
        .collect();
    ledger.set_handler(name, Some(Arc::new(Seeder { by_id })))?;
    for (id, entity) in ids {
        let mut job = Job::new(0, sub.id, key_hash(id.as_bytes()), 0, &id, &[], ack.clone());
        let shard = ledger.place(&sub, &mut job, entity);
        ledger.submit(shard, vec![job])?;
        match decided(acks)? {
            Outcome::Processed => {}
            other => {
                return Err(HarnessError::Setup(format!(
                    "seeding the state failed: {}",
                    other.reason().unwrap_or_else(|| other.name().to_string())
                )))
            }
        }
    }
    Ok(())
}

/// Fills a report from the calls the handler made for it: the committed effects are the
/// last call's, when the message was processed.
fn fill(report: &mut Report, recorded: Vec<Recorded>, outcome: &Outcome) {
    for call in recorded {
        let (result, error) = match &call.result {
            Ok(_) => ("ok", None),
            Err(f) => (f.kind(), Some(f.to_string())),
        };
        if let (Ok(effects), Outcome::Processed) = (&call.result, outcome) {
            report.state = effects
                .state
                .iter()
                .map(|(k, v)| StateWrite {
                    key: readable(k),
                    value: v.as_deref().map(readable),
                    deleted: v.is_none(),
                })
                .collect();
            report.uniques = effects
                .uniques
                .iter()
                .map(|m| {
                    let at = m.iter().position(|b| *b == 0).unwrap_or(m.len());
                    UniqueMark {
                        namespace: String::from_utf8_lossy(&m[..at]).into_owned(),
                        key: String::from_utf8_lossy(m.get(at + 1..).unwrap_or_default())
                            .into_owned(),
                    }
                })
                .collect();
            report.versions = effects
                .versions
                .iter()
                .map(|(key, version)| VersionSet {
                    key: key.clone(),
                    version: *version,
                })
                .collect();
            report.emitted = effects
                .outbox
                .iter()
                .map(|m| Emitted {
                    id: m.id.clone(),
                    topic: m.topic.clone(),
                    key: m.key.clone(),
                    headers: m.headers.clone(),
                    payload: readable(&m.payload),
                })
                .collect();
        }
        report.calls.push(CallReport {
            attempt: call.attempt,
            result,
            error,
            guards: call.trace.guards.into_iter().map(guard).collect(),
            logs: call
                .trace
                .logs
                .into_iter()
                .map(|l| LogLine {
                    level: l.level,
                    text: l.text,
                })
                .collect(),
            dropped_logs: call.trace.dropped_logs,
        });
    }
}

fn guard(g: GuardCall) -> Guard {
    match g {
        GuardCall::InsertUnique {
            namespace,
            key,
            inserted,
        } => Guard::InsertUnique {
            namespace,
            key,
            inserted,
        },
        GuardCall::AdvanceVersion {
            key,
            version,
            current,
            advanced,
        } => Guard::AdvanceVersion {
            key,
            version,
            current,
            advanced,
        },
        GuardCall::CompareAndSet { key, swapped } => Guard::CompareAndSet {
            key: readable(&key),
            swapped,
        },
    }
}

/// The reports as `--json` prints them: one compact JSON object per line.
pub fn json_lines(reports: &[Report]) -> String {
    let mut out = String::new();
    for r in reports {
        out.push_str(&serde_json::to_string(r).unwrap_or_default());
        out.push('\n');
    }
    out
}

/// A byte string as the human report shows it: text as it is, anything else as JSON.
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The reports for people: one header line per message, its committed writes, then each
/// handler call with its guard answers and log lines; a count of outcomes at the end.
pub fn write_human(reports: &[Report], mut out: impl std::io::Write) -> std::io::Result<()> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for r in reports {
        *counts.entry(r.outcome).or_default() += 1;
        write!(out, "line {}: ", r.line)?;
        if let Some(id) = &r.id {
            write!(out, "{id} ")?;
        }
        write!(out, "{}", r.outcome)?;
        if let Some(e) = &r.entity {
            write!(out, " (entity {e})")?;
        }
        match &r.reason {
            Some(reason) => writeln!(out, ": {reason}")?,
            None => writeln!(out)?,
        }
        for w in &r.state {
            match &w.value {
                Some(v) => writeln!(out, "  put     {} = {}", shown(&w.key), shown(v))?,
                None => writeln!(out, "  delete  {}", shown(&w.key))?,
            }
        }
        for u in &r.uniques {
            writeln!(out, "  unique  {} {}", u.namespace, u.key)?;
        }
        for v in &r.versions {
            writeln!(out, "  version {} = {}", v.key, v.version)?;
        }
        for m in &r.emitted {
            write!(out, "  emit    {}", m.topic)?;
            if let Some(k) = &m.key {
                write!(out, " key={k}")?;
            }
            for (k, v) in &m.headers {
                write!(out, " {k}={v}")?;
            }
            writeln!(out, " id={} {}", m.id, shown(&m.payload))?;
        }
        for c in &r.calls {
            match &c.error {
                Some(e) => writeln!(out, "  call {}: {}", c.attempt, e)?,
                None => writeln!(out, "  call {}: ok", c.attempt)?,
            }
            for g in &c.guards {
                let text = match g {
                    Guard::InsertUnique {
                        namespace,
                        key,
                        inserted,
                    } => format!(
                        "insert-unique {namespace} {key} -> {}",
                        if *inserted { "inserted" } else { "exists" }
                    ),
                    Guard::AdvanceVersion {
                        key,
                        version,
                        current,
                        advanced,
                    } => format!(
                        "advance-version {key} {version} (current {}) -> {}",
                        current.map_or("none".to_string(), |c| c.to_string()),
                        if *advanced { "advanced" } else { "stale" }
                    ),
                    Guard::CompareAndSet { key, swapped } => format!(
                        "compare-and-set {} -> {}",
                        shown(key),
                        if *swapped { "swapped" } else { "not swapped" }
                    ),
                };
                writeln!(out, "    {text}")?;
            }
            for l in &c.logs {
                writeln!(out, "    log {}: {}", l.level, l.text)?;
            }
            if c.dropped_logs > 0 {
                writeln!(out, "    ({} more log lines dropped)", c.dropped_logs)?;
            }
        }
    }
    let summary: Vec<String> = counts.iter().map(|(o, n)| format!("{n} {o}")).collect();
    writeln!(
        out,
        "{} messages: {}",
        reports.len(),
        if summary.is_empty() {
            "none".to_string()
        } else {
            summary.join(", ")
        }
    )
}

/// Compares the reports with an expected `--json` output (`file` names it). `Ok` with the
/// number of messages when equal; else a readable account of the first difference.
pub fn compare(file: &str, expected: &str, reports: &[Report]) -> Result<usize, String> {
    let mut want = Vec::new();
    for (line, text) in numbered(expected) {
        match serde_json::from_str::<Value>(text) {
            Ok(v) => want.push((line, v, text)),
            Err(e) => return Err(format!("{file}:{line}: not JSON: {}", json_reason(&e))),
        }
    }
    let got: Vec<Value> = reports
        .iter()
        .map(|r| serde_json::to_value(r).unwrap_or_default())
        .collect();
    for (i, ((line, w, text_w), g)) in want.iter().zip(&got).enumerate() {
        if w == g {
            continue;
        }
        let mut diffs = Vec::new();
        diff("", w, g, &mut diffs);
        let input_line = reports[i].line;
        let mut text = format!(
            "message {} (input line {input_line}) differs from {file}:{line}:\n",
            i + 1
        );
        for d in diffs.iter().take(20) {
            text.push_str(&format!("  {d}\n"));
        }
        if diffs.len() > 20 {
            text.push_str(&format!(
                "  ... and {} more differences\n",
                diffs.len() - 20
            ));
        }
        // As written and as `--json` prints it, not re-ordered.
        let actual = serde_json::to_string(&reports[i]).unwrap_or_default();
        text.push_str(&format!("expected: {text_w}\nactual:   {actual}\n"));
        return Err(text);
    }
    match want.len().cmp(&got.len()) {
        std::cmp::Ordering::Equal => Ok(got.len()),
        std::cmp::Ordering::Less => Err(format!(
            "{file} expects {} messages, the run gave {}; the first unexpected one:\nactual:   {}\n",
            want.len(),
            got.len(),
            serde_json::to_string(&reports[want.len()]).unwrap_or_default()
        )),
        std::cmp::Ordering::Greater => Err(format!(
            "{file} expects {} messages, the run gave {}; the first missing one ({file}:{}):\nexpected: {}\n",
            want.len(),
            got.len(),
            want[got.len()].0,
            want[got.len()].2
        )),
    }
}

/// The differences between two JSON values, one line each, named by JSON pointer.
fn diff(path: &str, want: &Value, got: &Value, out: &mut Vec<String>) {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            let keys: std::collections::BTreeSet<&String> = w.keys().chain(g.keys()).collect();
            for k in keys {
                let p = format!("{path}/{}", k.replace('~', "~0").replace('/', "~1"));
                match (w.get(k), g.get(k)) {
                    (Some(a), Some(b)) => diff(&p, a, b, out),
                    (Some(a), None) => out.push(format!("{p}: expected {a}, missing")),
                    (None, Some(b)) => out.push(format!("{p}: not expected, got {b}")),
                    (None, None) => {}
                }
            }
        }
        (Value::Array(w), Value::Array(g)) => {
            for i in 0..w.len().max(g.len()) {
                let p = format!("{path}/{i}");
                match (w.get(i), g.get(i)) {
                    (Some(a), Some(b)) => diff(&p, a, b, out),
                    (Some(a), None) => out.push(format!("{p}: expected {a}, missing")),
                    (None, Some(b)) => out.push(format!("{p}: not expected, got {b}")),
                    (None, None) => {}
                }
            }
        }
        (w, g) if w != g => {
            let p = if path.is_empty() { "/" } else { path };
            out.push(format!("{p}: expected {w}, got {g}"));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_lines_read_back_what_state_dump_prints() {
        let seed = parse_state(
            "s.jsonl",
            concat!(
                r#"{"key":"label/o-1","value":{"label_id":"x","order_id":"o-1"}}"#,
                "\n\n",
                r#"{"key":{"hex":"ff00"},"value":"plain","entity":"o-1"}"#,
                "\n",
                r#"{"unique":{"namespace":"label","key":"o-1"}}"#,
                "\n",
                r#"{"version":{"key":"order/o-1","version":3}}"#,
            ),
        )
        .unwrap();
        let entries: Vec<(usize, Option<&str>, &SeedEntry)> = seed
            .lines
            .iter()
            .map(|l| (l.line, l.entity.as_deref(), &l.entry))
            .collect();
        assert_eq!(
            entries,
            vec![
                (
                    1,
                    None,
                    &SeedEntry::State {
                        key: b"label/o-1".to_vec(),
                        value: br#"{"label_id":"x","order_id":"o-1"}"#.to_vec()
                    }
                ),
                (
                    3,
                    Some("o-1"),
                    &SeedEntry::State {
                        key: vec![0xff, 0],
                        value: b"plain".to_vec()
                    }
                ),
                (
                    4,
                    None,
                    &SeedEntry::Unique {
                        namespace: "label".into(),
                        key: "o-1".into()
                    }
                ),
                (
                    5,
                    None,
                    &SeedEntry::Version {
                        key: "order/o-1".into(),
                        version: 3
                    }
                ),
            ]
        );
        // What `readable` shows, `bytes_of` reads back.
        for bytes in [&b"text"[..], br#"{"a":1}"#, &[0xff, 0x01]] {
            assert_eq!(bytes_of(&readable(bytes)).unwrap(), bytes);
        }
    }

    #[test]
    fn bad_state_lines_name_their_line_and_reason() {
        for (text, reason) in [
            ("{\"key\":\"k\"}", "expected {\"key\": ..., \"value\": ...}"),
            (
                "{\"key\":\"k\",\"value\":1,\"extra\":2}",
                "unknown field `extra`",
            ),
            ("{\"key\":{\"hex\":\"zz\"},\"value\":1}", "not hexadecimal"),
            (
                "{\"unique\":{\"namespace\":\"\",\"key\":\"k\"}}",
                "namespace non-empty",
            ),
            ("[1]", "expected a JSON object"),
            ("{\"key\": ", "EOF"),
        ] {
            let text = format!("\n{{\"key\":\"a\",\"value\":\"b\"}}\n{text}\n");
            match parse_state("s.jsonl", &text) {
                Err(HarnessError::Line {
                    file,
                    line,
                    reason: r,
                }) => {
                    assert_eq!((file.as_str(), line), ("s.jsonl", 3), "{text}");
                    assert!(r.contains(reason), "{r:?} should contain {reason:?}");
                }
                other => panic!("{text}: expected a line error, got {other:?}"),
            }
        }
    }

    #[test]
    fn bad_message_lines_name_their_line_and_column() {
        let err = parse_messages("in.jsonl", "{\"id\":\"a\"}\n{\"id\":\"b\",\"paylod\":{}}\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("in.jsonl:2: not a message: unknown field `paylod`"),
            "{err}"
        );
        assert!(!err.contains("line 1 column"), "{err}");
    }

    #[test]
    fn compare_names_the_first_difference_by_pointer() {
        let report = Report {
            line: 4,
            id: Some("e-1".into()),
            entity: None,
            outcome: "processed",
            reason: None,
            state: vec![StateWrite {
                key: Value::String("k".into()),
                value: Some(serde_json::json!({"n": 2})),
                deleted: false,
            }],
            uniques: Vec::new(),
            versions: Vec::new(),
            emitted: Vec::new(),
            calls: Vec::new(),
        };
        let same = json_lines(std::slice::from_ref(&report));
        assert_eq!(compare("x", &same, std::slice::from_ref(&report)), Ok(1));
        let changed = same.replace(r#""n":2"#, r#""n":3"#);
        let err = compare("x", &changed, std::slice::from_ref(&report)).unwrap_err();
        assert!(
            err.contains("message 1 (input line 4) differs from x:1"),
            "{err}"
        );
        assert!(err.contains("/state/0/value/n: expected 3, got 2"), "{err}");
        // Both shown as written and as `--json` prints them.
        assert!(
            err.contains(&format!("expected: {}\n", changed.trim())),
            "{err}"
        );
        assert!(
            err.contains("actual:   {\"line\":4,\"id\":\"e-1\""),
            "{err}"
        );
        let err =
            compare("x", &format!("{same}{same}"), std::slice::from_ref(&report)).unwrap_err();
        assert!(
            err.contains("x expects 2 messages, the run gave 1"),
            "{err}"
        );
    }
}
