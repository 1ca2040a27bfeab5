//! The subscriber registry: name -> subscriber, with each subscriber's settings, handler,
//! counters and placements. Shared by sources (which resolve names) and shards (which
//! pick up settings and handler changes between batches); kept apart from the ledger's
//! storage because nothing here touches redb.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use super::{placement, LedgerError, Placement};
use crate::config::{validate_subscriber_name, Config, SubscriberSettings};
use crate::effects::HandlerFactory;

/// Index of a subscriber in the ledger's registry (not stored on disk; names are).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SubscriberId(pub u32);

/// Live counters of one subscriber across all shards.
#[derive(Debug, Default)]
pub struct SubscriberCounters {
    pub processed: AtomicU64,
    pub duplicates: AtomicU64,
    pub(crate) quarantined: AtomicU64,
    pub(crate) sliding_refreshes: AtomicU64,
    /// Probes of sealed-generation filters, and how many answered "maybe" without a match.
    pub(crate) filter_probes: AtomicU64,
    pub(crate) filter_false_positives: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Handler attempts that failed and were scheduled again.
    pub retries: AtomicU64,
    /// Outcomes sent to their sources after a durable commit, and the sum of their
    /// latencies in microseconds (job built to outcome sent, handler retries included):
    /// the mean ack latency of an interval is the ratio of the two differences.
    pub acked: AtomicU64,
    pub ack_latency_us: AtomicU64,
    /// Failed handler attempts by kind, in the order of [`HANDLER_FAILURE_KINDS`].
    pub(crate) handler_failures: [AtomicU64; 5],
    /// Messages dead-lettered without a handler call while its circuit breaker was open.
    pub handler_calls_skipped: AtomicU64,
    /// Handler calls set aside while the subscriber used more than its share of a busy
    /// shard's time (each is called later; a message may be set aside several times).
    pub handler_calls_deferred: AtomicU64,
    /// Times a shard's circuit breaker of this subscriber opened.
    pub handler_circuits_opened: AtomicU64,
    /// Stored quarantine records removed by retention or the cap (not by operators).
    pub quarantine_records_dropped: RecordsDropped,
    /// Stored dead-letter records removed by retention or the cap (not by operators).
    pub(crate) dead_letter_records_dropped: RecordsDropped,
}

/// Stored records the ledger removed on its own, by reason.
#[derive(Debug, Default)]
pub struct RecordsDropped {
    /// First stored longer ago than `ledger.record_retention`.
    pub expired: AtomicU64,
    /// The oldest record, dropped for a new one past `ledger.max_records_per_subscriber`.
    pub evicted: AtomicU64,
}

/// Kinds of handler failure counted in [`SubscriberCounters::handler_failures`]
/// (the names of `Failure::kind`).
pub(crate) const HANDLER_FAILURE_KINDS: [&str; 5] =
    ["retryable", "permanent", "timeout", "memory", "trap"];

impl SubscriberCounters {
    /// Failed handler attempts by kind name.
    pub fn handler_failures_by_kind(&self) -> [(&'static str, u64); 5] {
        std::array::from_fn(|i| {
            (
                HANDLER_FAILURE_KINDS[i],
                self.handler_failures[i].load(Ordering::Relaxed),
            )
        })
    }
}

/// A subscriber known to the ledger.
#[derive(Debug)]
pub struct Subscriber {
    pub id: SubscriberId,
    pub(crate) name: Arc<str>,
    pub(super) settings: RwLock<Arc<SubscriberSettings>>,
    /// Bumped by every settings change; shards compare it between batches.
    pub(super) settings_epoch: AtomicU64,
    pub counters: SubscriberCounters,
    /// The handler in force; shards pick up a change between batches.
    pub(super) handler: RwLock<Option<Arc<dyn HandlerFactory>>>,
    /// Whether `handler` holds one (read per message by [`Ledger::place`]).
    pub(super) has_handler: AtomicBool,
    /// Placements its claims were written under, on disk and in this run (see
    /// `placement.rs`): decides whether shards probe each other for its claims.
    pub(super) placements: AtomicU8,
    /// Where its shards publish changes before committing (`changelog.rs`).
    pub(super) changelog: super::changelog::SinkSlot,
    /// Whether `changelog` holds one (read per message by sources, like `has_handler`).
    pub(super) has_changelog: AtomicBool,
    /// The key sources its stored claims were made with (as the shards recorded them in
    /// `key_sources_v1`), each with the engine time no claim made with it lives past (an
    /// upper bound: the newest expiry a shard loaded or wrote). A few entries at most.
    pub(super) claims_key_sources: Mutex<Vec<(Arc<str>, u64)>>,
}

impl Subscriber {
    /// The settings in force (key source, TTL, retry policy...).
    pub fn settings(&self) -> Arc<SubscriberSettings> {
        self.settings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether a handler is attached now (read per message: a source that reads it once
    /// for a message places that message by the same reading, [`super::Ledger::place_as`]).
    pub(crate) fn has_handler(&self) -> bool {
        self.has_handler.load(Ordering::Acquire)
    }

    pub(crate) fn settings_epoch(&self) -> u64 {
        self.settings_epoch.load(Ordering::Acquire)
    }

    /// Where this subscriber's new messages are decided.
    pub(crate) fn placement(&self) -> Placement {
        let settings = self.settings();
        Placement::of(
            self.has_handler.load(Ordering::Acquire),
            settings.partition_key != crate::config::PartitionSource::IdempotencyKey,
        )
    }

    /// Whether its handler state is stored per entity (keys `entity NUL key`): it was
    /// written under an entity placement (mixing scopes is refused at start).
    pub(crate) fn state_per_entity(&self) -> bool {
        self.placements.load(Ordering::Acquire) & placement::ENTITY != 0
    }

    /// Notes claims made with key source `key` that live until `until_ms` at most.
    pub(super) fn note_claims(&self, key: &Arc<str>, until_ms: u64) {
        let mut sources = self
            .claims_key_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match sources.iter_mut().find(|(k, _)| **k == **key) {
            Some((_, until)) => *until = (*until).max(until_ms),
            None => sources.push((key.clone(), until_ms)),
        }
    }

    /// A key source other than `key` whose claims live after `now_ms`, and until when.
    pub(super) fn live_claims_of_another_key_source(
        &self,
        key: &str,
        now_ms: u64,
    ) -> Option<(Arc<str>, u64)> {
        self.claims_key_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(k, until)| **k != *key && *until > now_ms)
            .cloned()
    }

    /// Whether its processed messages are published to a changelog.
    pub(crate) fn has_changelog(&self) -> bool {
        self.has_changelog.load(Ordering::Acquire)
    }

    /// The changelog sink in force, if any.
    pub(crate) fn changelog(&self) -> Option<Arc<dyn super::changelog::ChangelogSink>> {
        self.changelog
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The handler in force, if any.
    pub(crate) fn handler(&self) -> Option<Arc<dyn HandlerFactory>> {
        self.handler
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[derive(Debug, Default)]
struct RegistryInner {
    by_name: HashMap<String, Arc<Subscriber>>,
    by_id: Vec<Arc<Subscriber>>,
}

/// Name -> subscriber, shared by sources and shards.
#[derive(Debug)]
pub(crate) struct Registry {
    pub(super) config: Config,
    inner: RwLock<RegistryInner>,
    /// Handler given to subscribers that take `[defaults]` when they first appear.
    pub(super) default_handler: RwLock<Option<Arc<dyn HandlerFactory>>>,
}

impl Registry {
    pub(super) fn new(config: Config) -> Self {
        Registry {
            config,
            inner: RwLock::new(RegistryInner::default()),
            default_handler: RwLock::new(None),
        }
    }

    /// Finds or registers a subscriber. `existing` registers names found on disk even when
    /// the config would refuse them, so their claims keep protecting. A new unconfigured
    /// name (`existing` false) is refused once `ledger.max_implicit_subscribers`
    /// unconfigured subscribers are registered (those found on disk count too): each one
    /// costs memory on every shard, and sources create them from message content.
    /// Whether `name` is configured or has anything stored (it was registered, by the
    /// shards as they opened or by a message since).
    pub(super) fn known(&self, name: &str) -> bool {
        self.config.subscribers.iter().any(|s| s.name == name)
            || self
                .inner
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .by_name
                .contains_key(name)
    }

    /// The settings `name` has or would get, without registering it: a source checks a
    /// request against them first, so one that is refused uses up no implicit subscriber.
    pub(super) fn settings_of(
        &self,
        name: &str,
    ) -> Result<Arc<crate::config::SubscriberSettings>, LedgerError> {
        if let Some(s) = self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_name
            .get(name)
        {
            return Ok(s.settings());
        }
        validate_subscriber_name("subscriber", name).map_err(|_| {
            LedgerError::InvalidSubscriber(format!(
                "{name:?} is not a valid subscriber name (1-64 of A-Z a-z 0-9 . _ -, not only dots)"
            ))
        })?;
        self.config
            .settings_for(name)
            .map(Arc::new)
            .ok_or_else(|| LedgerError::UnknownSubscriber {
                name: name.to_string(),
            })
    }

    pub(super) fn resolve(
        &self,
        name: &str,
        existing: bool,
    ) -> Result<Arc<Subscriber>, LedgerError> {
        if let Some(s) = self
            .inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_name
            .get(name)
        {
            return Ok(s.clone());
        }
        validate_subscriber_name("subscriber", name).map_err(|_| {
            LedgerError::InvalidSubscriber(format!(
                "{name:?} is not a valid subscriber name (1-64 of A-Z a-z 0-9 . _ -, not only dots)"
            ))
        })?;
        let configured = self.config.subscribers.iter().any(|s| s.name == name);
        let settings = match self.config.settings_for(name) {
            Some(s) => s,
            None if existing => self.config.defaults.clone(),
            None => {
                return Err(LedgerError::UnknownSubscriber {
                    name: name.to_string(),
                })
            }
        };
        let mut inner = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = inner.by_name.get(name) {
            return Ok(s.clone());
        }
        if !configured && !existing {
            self.check_implicit_limit(&inner, name)?;
        }
        let handler = if configured {
            None
        } else {
            self.default_handler
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
        };
        let sub = Arc::new(Subscriber {
            id: SubscriberId(inner.by_id.len() as u32),
            name: Arc::from(name),
            settings: RwLock::new(Arc::new(settings)),
            settings_epoch: AtomicU64::new(0),
            counters: SubscriberCounters::default(),
            has_handler: AtomicBool::new(handler.is_some()),
            handler: RwLock::new(handler),
            placements: AtomicU8::new(0),
            changelog: RwLock::new(None),
            has_changelog: AtomicBool::new(false),
            claims_key_sources: Mutex::new(Vec::new()),
        });
        inner.by_id.push(sub.clone());
        inner.by_name.insert(name.to_string(), sub.clone());
        Ok(sub)
    }

    fn check_implicit_limit(&self, inner: &RegistryInner, name: &str) -> Result<(), LedgerError> {
        let limit = self.config.ledger.max_implicit_subscribers;
        let unconfigured = inner
            .by_id
            .iter()
            .filter(|s| !self.config.subscribers.iter().any(|c| *c.name == *s.name))
            .count();
        if unconfigured >= limit {
            return Err(LedgerError::TooManySubscribers {
                name: name.to_string(),
                limit,
            });
        }
        Ok(())
    }

    pub(super) fn get(&self, id: SubscriberId) -> Option<Arc<Subscriber>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_id
            .get(id.0 as usize)
            .cloned()
    }

    pub(super) fn all(&self) -> Vec<Arc<Subscriber>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .by_id
            .clone()
    }
}
