//! One run: the user's config made a test config, a ledger on a temporary directory, the
//! component wrapped to record every call, the state seeded through the commit path, and
//! each message decided in a batch of its own and turned into a [`Report`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::report::{
    CallReport, Emitted, Guard, LogLine, Report, StateWrite, UniqueMark, VersionSet,
};
use super::{HarnessError, Messages, Options, Seed, SeedEntry};
use crate::clock::ManualClock;
use crate::config::{Config, PartitionSource, SubscriberConfig};
use crate::effects::{
    unique_key, Effects, Failure, HandlerFactory, HandlerMessage, MessageHandler, StateReader,
};
use crate::envelope::key_hash;
use crate::handler::{CallTrace, Component, GuardCall, WasmHandler};
use crate::inspect::readable;
use crate::ledger::{Job, Ledger, Outcome};
use crate::source::delivery::{route, Keying, RouteError, Target};

/// How long one message may take to be decided before the run is given up.
const DECIDE_TIMEOUT: Duration = Duration::from_secs(120);

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
        if let Some(other) = input.message.subscriber.as_deref().filter(|s| *s != name) {
            return Err(HarnessError::Line {
                file: messages.file.clone(),
                line: input.line,
                reason: format!(
                    "the message is for subscriber {other:?}, the test runs {name:?} (--subscriber)"
                ),
            });
        }
        let delivery = input
            .message
            .clone()
            .into_delivery(Target::Resolved(sub.clone()));
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
        match route(ledger, delivery, Keying::Derive, ack.clone()) {
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
                    RouteError::Entity { key, .. } => Some(key.text.clone()),
                    _ => input.message.id.clone(),
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
