//! The claim ledger: the only module that imports redb.
//!
//! A [`Ledger`] owns N shards. Each shard is one redb file and one writer thread; a message
//! id always routes to the same shard (`route`, part of the on-disk format). A writer takes
//! every message queued since its last commit as one batch (group commit: the batch grows
//! while the previous fsync runs), decides each message against its claims, and commits the
//! new claims with `Durability::Immediate` before it releases any outcome (G1).
//!
//! Claims of a subscriber live in generations (see `docs/design.md`): an active generation
//! (exact in-memory index + append-only log table), sealed generations (sorted tables with
//! a static filter each), merged when small, dropped whole when every claim has expired.

mod blocks;
mod fault;
pub mod filter;
mod generation;
mod handlers;
mod marks;
mod ops;
mod outbox;
mod placement;
mod poison;
pub mod record;
mod records;
mod registry;
mod shard;
mod tables;
mod view;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Sender};
use serde::{Deserialize, Serialize};

use crate::clock::Clock;
use crate::config::{Config, LedgerConfig};
use crate::effects::HandlerFactory;
use crate::effects::StateEntry;
pub use ops::{OutboxRow, RecordKind, StoredRecord};
pub use placement::{entity_scope, Placement};
pub use poison::PoisonHook;
pub use record::{ClaimRecord, FORMAT_VERSION};
pub use records::StoredPayload;
pub(crate) use registry::Registry;
pub use registry::{
    RecordsDropped, Subscriber, SubscriberCounters, SubscriberId, HANDLER_FAILURE_KINDS,
};
use shard::{Control, PeerMsg, ShardMsg};

/// What a caller should do about a ledger error is in its text; every variant is fatal for
/// acking: after one, nothing more is acknowledged (G7).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    #[error("data directory {path} is in use by another dedupd process; stop it or use another --data-dir")]
    InUse { path: PathBuf },
    #[error("data directory {path} was written by a newer dedupd (format {found}, this build reads up to {supported}); upgrade dedupd")]
    NewerFormat {
        path: PathBuf,
        found: u64,
        supported: u64,
    },
    #[error("data directory {path} has {found} shards but the config asks for {configured}; the shard count is fixed when a data directory is created: remove `ledger.shards` or set it to {found}")]
    ShardCountMismatch {
        path: PathBuf,
        found: usize,
        configured: usize,
    },
    #[error("{path} is corrupt: {detail}. Restore it from a backup; dedupd will not guess")]
    Corrupt { path: PathBuf, detail: String },
    #[error("shard file {path} is missing although the manifest names it; an empty one would forget every claim it held. Restore it from a backup (or, if this data directory never acknowledged anything, remove the directory)")]
    MissingShard { path: PathBuf },
    #[error("storage error in {path}: {detail}. The ledger stopped acknowledging; restart dedupd after fixing the cause")]
    Storage { path: PathBuf, detail: String },
    #[error("the writer thread of {path} panicked: {detail}. Nothing of its batch was committed and the ledger stopped acknowledging; restart dedupd (a native handler's bug repeats on the same message)")]
    Panicked { path: PathBuf, detail: String },
    #[error("cannot use data directory {path}: {detail}")]
    DataDir { path: PathBuf, detail: String },
    #[error("subscriber {name:?} is not configured and `allow_unknown_subscribers` is false")]
    UnknownSubscriber { name: String },
    #[error("{0}")]
    InvalidSubscriber(String),
    #[error("subscriber {name:?} is not configured and {limit} unconfigured subscribers exist already (`ledger.max_implicit_subscribers`); each costs memory on every shard: add it to the config as a [[subscriber]], or raise the limit")]
    TooManySubscribers { name: String, limit: usize },
    #[error("the ledger is stopped after an earlier failure: {0}")]
    Poisoned(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
}

/// The decision for one message. Released to its source only after it is durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// First delivery: claimed (and, with a handler, its writes committed).
    Processed,
    /// A live claim with the same payload fingerprint exists.
    Duplicate,
    /// A live claim exists with another payload fingerprint; the message is kept aside (G4).
    Quarantined { stored_fingerprint: u64 },
    /// The message could not be processed and was set aside with a reason, after
    /// `attempts` handler calls (the last one included).
    DeadLettered { reason: String, attempts: u32 },
    /// The input was unusable (malformed, no key, oversized key, unknown subscriber).
    Rejected { reason: String },
    /// The ledger failed to make the outcome durable; nothing may be acknowledged (G7).
    Failed { reason: String },
}

impl Outcome {
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::Quarantined { .. } => "quarantined",
            Outcome::DeadLettered { .. } => "dead_lettered",
            Outcome::Rejected { .. } => "rejected",
            Outcome::Failed { .. } => "failed",
        }
    }

    pub fn reason(&self) -> Option<String> {
        match self {
            Outcome::Quarantined { stored_fingerprint } => Some(format!(
                "same id, different payload (stored fingerprint {stored_fingerprint:016x})"
            )),
            Outcome::DeadLettered { reason, .. }
            | Outcome::Rejected { reason }
            | Outcome::Failed { reason } => Some(reason.clone()),
            Outcome::Processed | Outcome::Duplicate => None,
        }
    }
}

/// A decided message: its source sequence number and outcome.
#[derive(Debug, Clone)]
pub struct Done {
    pub seq: u64,
    pub outcome: Outcome,
}

/// Where a shard sends outcomes after commit; one per source.
pub type AckSender = Sender<Vec<Done>>;

/// One keyed message on its way to a shard.
#[derive(Debug)]
pub struct Job {
    /// The source's sequence number, echoed in [`Done`].
    pub seq: u64,
    pub subscriber: SubscriberId,
    /// 128-bit hash of the idempotency key.
    pub key: u128,
    /// xxh3-64 of the canonical payload.
    pub fingerprint: u64,
    /// The idempotency key's text, kept in quarantine records.
    pub id: Box<str>,
    /// The canonical payload, kept in quarantine records (and given to handlers).
    pub payload: Box<[u8]>,
    pub ack: AckSender,
    /// Headers and partition key, for handlers and dead-letter records.
    pub headers: Vec<(String, String)>,
    pub partition_key: Option<String>,
    /// 1 on the first attempt; the shard counts retries.
    pub attempt: u32,
    /// When the source received the message (0: when the shard first decides it).
    pub received_at_ms: u64,
    /// Where the message came from (e.g. `kafka:orders/3/1234`), kept in dead-letter and
    /// quarantine records.
    pub origin: Option<String>,
    /// A stored record this job replays; removed with the job's final outcome.
    pub(crate) settle: Option<(RecordKind, u64)>,
    /// Replaces a live claim with another payload instead of quarantining (replay of a
    /// quarantined message).
    pub(crate) replace: bool,
    /// How [`Ledger::place`] chose the shard.
    pub placement: Placement,
    /// The partition key's text under [`Placement::Entity`]: handler state is scoped to it.
    pub entity: Option<Box<str>>,
    /// The newest record the other shards hold for this key, once they were asked
    /// (`placement.rs`). While `Some`, this shard holds the key in the in-flight set.
    pub(crate) probed: Option<Option<ClaimRecord>>,
}

impl Job {
    /// A first attempt with no headers or partition key.
    pub fn new(
        seq: u64,
        subscriber: SubscriberId,
        key: u128,
        fingerprint: u64,
        id: &str,
        payload: &[u8],
        ack: AckSender,
    ) -> Job {
        Job {
            seq,
            subscriber,
            key,
            fingerprint,
            id: id.into(),
            payload: payload.into(),
            ack,
            headers: Vec::new(),
            partition_key: None,
            attempt: 1,
            received_at_ms: 0,
            origin: None,
            settle: None,
            replace: false,
            placement: Placement::ByKey,
            entity: None,
            probed: None,
        }
    }
}

/// What `inspect` shows of one subscriber.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SubscriberReport {
    pub subscriber: String,
    /// Claims stored (including expired ones not yet dropped).
    pub claims: u64,
    pub active_claims: u64,
    pub sealed_generations: u64,
    /// Messages quarantined (outcomes counted, repeats included).
    pub quarantined: u64,
    /// Quarantine records stored (one per message id and payload, within retention and cap).
    #[serde(default)]
    pub quarantine_records: u64,
    /// Messages dead-lettered (outcomes counted, repeats included).
    pub dead_lettered: u64,
    /// Dead-letter records stored.
    #[serde(default)]
    pub dead_letter_records: u64,
    pub filter_bytes: u64,
    pub index_bytes: u64,
}

/// What `inspect` shows of the whole data directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LedgerReport {
    pub data_dir: PathBuf,
    pub format_version: u64,
    pub shards: usize,
    pub file_bytes: u64,
    pub subscribers: Vec<SubscriberReport>,
}

/// Commit-level measurements of one shard.
#[derive(Debug, Clone, Default)]
pub struct ShardMetrics {
    pub batches: u64,
    pub messages: u64,
    pub commits: u64,
    /// Longest batch (decide + maintenance + commit) with and without sealing/merging work.
    pub max_batch_us_maintenance: u64,
    pub max_batch_us_plain: u64,
    /// Longest durable commit (the fsync part of a batch).
    pub max_commit_us: u64,
    pub seals: u64,
    pub merges: u64,
    pub dropped_generations: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format_version: u64,
    shards: usize,
}

const MANIFEST: &str = "dedupd.manifest.json";

struct ShardHandle {
    tx: Sender<ShardMsg>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The engine's storage: shards, routing and the subscriber registry.
pub struct Ledger {
    data_dir: PathBuf,
    shards: Vec<ShardHandle>,
    registry: Arc<Registry>,
    poison: Arc<poison::Poison>,
    metrics: Vec<Arc<Mutex<ShardMetrics>>>,
    clock: Arc<dyn Clock>,
}

/// The shard a hash routes to among `shards`. Part of the on-disk format.
#[inline]
pub(crate) fn route_hash(hash: u128, shards: usize) -> usize {
    ((hash >> 64) as u64 % shards as u64) as usize
}

impl Ledger {
    /// Opens (or creates) a data directory. Returns only when every shard has loaded its
    /// filters and replayed its active generations, so no message is decided against a
    /// half-loaded state (G3).
    pub fn open(
        data_dir: &Path,
        config: &Config,
        clock: Arc<dyn Clock>,
    ) -> Result<Ledger, LedgerError> {
        Ledger::open_inner(data_dir, config, clock, None)
    }

    /// Like [`Ledger::open`], with a switch that makes every shard file fail all writes
    /// and fsyncs after a chosen number of further fsyncs. For crash-consistency tests.
    #[doc(hidden)]
    pub fn open_with_fault_switch(
        data_dir: &Path,
        config: &Config,
        clock: Arc<dyn Clock>,
    ) -> Result<(Ledger, FaultSwitch), LedgerError> {
        let budget = Arc::new(std::sync::atomic::AtomicI64::new(i64::MAX));
        let ledger = Ledger::open_inner(data_dir, config, clock, Some(budget.clone()))?;
        Ok((ledger, FaultSwitch(budget)))
    }

    fn open_inner(
        data_dir: &Path,
        config: &Config,
        clock: Arc<dyn Clock>,
        fault: Option<Arc<std::sync::atomic::AtomicI64>>,
    ) -> Result<Ledger, LedgerError> {
        let (shard_count, created) = prepare_data_dir(data_dir, &config.ledger)?;
        if !created {
            require_shard_files(data_dir, shard_count)?;
        }
        let registry = Arc::new(Registry::new(config.clone()));
        let poison = Arc::new(poison::Poison::default());
        let builder = generation::Builder::spawn();
        let peers: Arc<std::sync::OnceLock<Vec<Sender<PeerMsg>>>> = Default::default();
        let mut peer_txs = Vec::with_capacity(shard_count);
        let inflight = Arc::new(placement::InFlight::default());
        let mut opening = Vec::new();
        for index in 0..shard_count {
            let (tx, rx) = bounded::<ShardMsg>(64);
            // Unbounded: a shard never blocks sending a probe or a reply, so two shards
            // asking each other cannot deadlock. Bounded by the messages in flight.
            let (peer_tx, peer_rx) = crossbeam_channel::unbounded::<PeerMsg>();
            peer_txs.push(peer_tx);
            let (ready_tx, ready_rx) = bounded(1);
            let path = shard_path(data_dir, index);
            let metrics = Arc::new(Mutex::new(ShardMetrics::default()));
            let ctx = shard::ShardContext {
                path,
                index,
                count: shard_count,
                config: config.ledger.clone(),
                registry: registry.clone(),
                clock: clock.clone(),
                poison: poison.clone(),
                metrics: metrics.clone(),
                builder: builder.clone(),
                fault: fault.clone(),
                peers: peers.clone(),
                inflight: inflight.clone(),
            };
            let thread =
                shard::spawn(ctx, rx, peer_rx, ready_tx).map_err(|e| LedgerError::DataDir {
                    path: data_dir.to_path_buf(),
                    detail: format!("cannot start shard thread: {e}"),
                })?;
            opening.push((
                ShardHandle {
                    tx,
                    thread: Mutex::new(Some(thread)),
                },
                ready_rx,
                metrics,
            ));
        }
        // Set before any shard can receive a job: `open` has not returned yet.
        let _ = peers.set(peer_txs);
        let mut shards = Vec::new();
        let mut all_metrics = Vec::new();
        let mut first_err = None;
        for (handle, ready, metrics) in opening {
            match ready.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(LedgerError::DataDir {
                        path: data_dir.to_path_buf(),
                        detail: "a shard thread died while opening".into(),
                    });
                }
            }
            shards.push(handle);
            all_metrics.push(metrics);
        }
        let ledger = Ledger {
            data_dir: data_dir.to_path_buf(),
            shards,
            registry,
            poison,
            metrics: all_metrics,
            clock,
        };
        if first_err.is_none() && created {
            // The new shard files' directory entries, durable before anything is acked.
            if let Err(e) = sync_dir(data_dir) {
                first_err = Some(LedgerError::DataDir {
                    path: data_dir.to_path_buf(),
                    detail: format!("cannot sync the directory after creating shard files: {e}"),
                });
            }
        }
        match first_err {
            Some(e) => {
                ledger.shutdown();
                Err(e)
            }
            None => Ok(ledger),
        }
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The shard a hash routes to. Part of the on-disk format: never change it for an
    /// existing data directory. Sources route jobs with [`Ledger::place`].
    #[inline]
    pub fn route(&self, hash: u128) -> usize {
        route_hash(hash, self.shards.len())
    }

    /// Chooses the shard that decides a keyed job under its subscriber's placement
    /// (`placement.rs`) and records the placement in the job. `entity` is the partition
    /// key's text when the subscriber configures one ([`crate::envelope::derive_entity`]);
    /// it matters only to subscribers with a handler.
    pub fn place(&self, sub: &Subscriber, job: &mut Job, entity: Option<String>) -> usize {
        let placement = Placement::of(sub.has_handler.load(Ordering::Acquire), entity.is_some());
        let bit = placement.bit();
        if sub.placements.load(Ordering::Acquire) & bit == 0 {
            sub.placements.fetch_or(bit, Ordering::AcqRel);
        }
        job.placement = placement;
        match placement {
            Placement::ByKey => self.route(job.key),
            Placement::Subscriber => self.route(crate::envelope::key_hash(sub.name.as_bytes())),
            Placement::Entity => {
                let shard = self.route(crate::envelope::key_hash(
                    entity.as_deref().unwrap_or_default().as_bytes(),
                ));
                job.entity = entity.map(String::into_boxed_str);
                shard
            }
        }
    }

    /// Refuses a handler placement under which the subscriber's existing handler state
    /// would be split or invisible: state written under the subscriber placement is one
    /// unscoped store, state written under an entity placement is scoped per entity, and
    /// state written by format 1 may be split across shards.
    fn check_state_scope(&self, sub: &Subscriber, next: Placement) -> Result<(), LedgerError> {
        let other = match next {
            Placement::ByKey => return Ok(()),
            Placement::Subscriber => placement::ENTITY | placement::ANYWHERE,
            Placement::Entity => placement::SUBSCRIBER | placement::ANYWHERE,
        };
        let mask = sub.placements.load(Ordering::Acquire);
        if mask & other == 0 || self.state_len(&sub.name)? == 0 {
            return Ok(());
        }
        let written = if mask & placement::ANYWHERE != 0 {
            "by an older dedupd (format 1), which split it by shard"
        } else if mask & placement::ENTITY != 0 {
            "scoped per entity (a partition key was configured)"
        } else {
            "as one store (no partition key was configured)"
        };
        let wanted = match next {
            Placement::Entity => "scoped per entity, because a partition key is configured now",
            _ => "as one store, because no partition key is configured now",
        };
        Err(LedgerError::Invalid(format!(
            "subscriber {:?} has handler state written {written}; its handler would read it {wanted}, \
             and would miss entries (one order, two labels). Restore the subscriber's earlier \
             `partition_key`, or give the handler a new subscriber name or data directory \
             (`dedupd state dump` prints the old state)",
            sub.name
        )))
    }

    /// Makes every shard probe for `sub`'s claims before its messages may be decided under
    /// `next`, when its claims were written under another placement. Returns after every
    /// shard finished the batch it was in, so no shard still decides without probing.
    fn prepare_placement(&self, sub: &Subscriber, next: Placement) -> Result<(), LedgerError> {
        let before = sub.placements.fetch_or(next.bit(), Ordering::AcqRel);
        if before == 0 || before & next.bit() != 0 {
            return Ok(());
        }
        tracing::info!(subscriber = %sub.name, placement = ?next,
            "placement changed: shards now ask each other for this subscriber's claims");
        let mut replies = Vec::new();
        for i in 0..self.shards.len() {
            let (tx, rx) = bounded(1);
            self.control(i, Control::Sync { reply: tx })?;
            replies.push(rx);
        }
        for rx in replies {
            rx.recv()
                .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))?;
        }
        Ok(())
    }

    /// Looks up or registers a subscriber by name.
    pub fn subscriber(&self, name: &str) -> Result<Arc<Subscriber>, LedgerError> {
        self.registry.resolve(name, false)
    }

    /// Sets (or removes) a subscriber's handler. Each shard switches between two batches,
    /// never inside one; claims record the version of the handler that processed them.
    pub fn set_handler(
        &self,
        subscriber: &str,
        handler: Option<Arc<dyn HandlerFactory>>,
    ) -> Result<(), LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        self.install_handler(&sub, handler)
    }

    fn install_handler(
        &self,
        sub: &Subscriber,
        handler: Option<Arc<dyn HandlerFactory>>,
    ) -> Result<(), LedgerError> {
        let keyed = sub.settings().partition_key != crate::config::PartitionSource::IdempotencyKey;
        let next = Placement::of(handler.is_some(), keyed);
        self.check_state_scope(sub, next)?;
        self.prepare_placement(sub, next)?;
        let mut slot = sub.handler.write().unwrap_or_else(|p| p.into_inner());
        sub.has_handler.store(handler.is_some(), Ordering::Release);
        *slot = handler;
        Ok(())
    }

    /// The handler for subscribers that take `[defaults]`, now and when they first appear.
    pub fn set_default_handler(&self, handler: Option<Arc<dyn HandlerFactory>>) {
        *self
            .registry
            .default_handler
            .write()
            .unwrap_or_else(|p| p.into_inner()) = handler.clone();
        let configured: Vec<&str> = self
            .registry
            .config
            .subscribers
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        for sub in self.registry.all() {
            if !configured.contains(&&*sub.name) {
                if let Err(e) = self.install_handler(&sub, handler.clone()) {
                    tracing::error!(subscriber = %sub.name, error = %e, "default handler not installed");
                }
            }
        }
    }

    /// All subscribers known so far (configured, seen on disk, or seen in traffic).
    pub fn subscribers(&self) -> Vec<Arc<Subscriber>> {
        self.registry.all()
    }

    /// Sends jobs that all route to `shard`. Blocks while the shard's queue is full
    /// (backpressure). Outcomes arrive on each job's `ack` after commit.
    pub fn submit(&self, shard: usize, jobs: Vec<Job>) -> Result<(), LedgerError> {
        if let Some(reason) = self.poison_reason() {
            return Err(LedgerError::Poisoned(reason));
        }
        self.shards[shard]
            .tx
            .send(ShardMsg::Jobs(jobs))
            .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))
    }

    /// The failure (storage error or writer panic) that stopped the ledger, if any.
    pub fn poison_reason(&self) -> Option<String> {
        self.poison.reason()
    }

    /// Runs `hook` once with the reason when the ledger fails (a storage error or a shard
    /// writer's panic), or at once if it already has. Hooks must not block.
    pub fn on_poison(&self, hook: PoisonHook) {
        self.poison.on_set(hook);
    }

    /// The newest claim for `(subscriber, key)`, live or expired, or `None`. Asks every
    /// shard: a claim lives where its message was decided, which depends on the placement
    /// in force then (`placement.rs`); the newest record across shards wins (I2).
    pub fn lookup(&self, subscriber: &str, key: u128) -> Result<Option<ClaimRecord>, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let mut replies = Vec::new();
        for i in 0..self.shards.len() {
            let (tx, rx) = bounded(1);
            self.control(
                i,
                Control::Lookup {
                    sub: sub.id,
                    key,
                    reply: tx,
                },
            )?;
            replies.push(rx);
        }
        let mut newest: Option<ClaimRecord> = None;
        for rx in replies {
            let found = rx
                .recv()
                .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))??;
            newest = ClaimRecord::newer(newest, found);
        }
        Ok(newest.filter(|r| !r.is_tombstone()))
    }

    /// Seals every active generation (when `seal_all`), then runs sealing, merging and
    /// expiry until no such work is left. Each step is its own durable commit.
    pub fn maintain(&self, seal_all: bool) -> Result<(), LedgerError> {
        let mut replies = Vec::new();
        for i in 0..self.shards.len() {
            let (tx, rx) = bounded(1);
            self.control(
                i,
                Control::Maintain {
                    seal_all,
                    reply: tx,
                },
            )?;
            replies.push(rx);
        }
        for rx in replies {
            rx.recv()
                .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))??;
        }
        Ok(())
    }

    /// Per-subscriber counts summed over shards.
    pub fn report(&self) -> Result<LedgerReport, LedgerError> {
        let mut by_name: std::collections::BTreeMap<String, SubscriberReport> = Default::default();
        for i in 0..self.shards.len() {
            let (tx, rx) = bounded(1);
            self.control(i, Control::Report { reply: tx })?;
            let rows = rx
                .recv()
                .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))??;
            for r in rows {
                let e = by_name
                    .entry(r.subscriber.clone())
                    .or_insert_with(|| SubscriberReport {
                        subscriber: r.subscriber.clone(),
                        ..Default::default()
                    });
                e.claims += r.claims;
                e.active_claims += r.active_claims;
                e.sealed_generations += r.sealed_generations;
                e.quarantined += r.quarantined;
                e.quarantine_records += r.quarantine_records;
                e.dead_lettered += r.dead_lettered;
                e.dead_letter_records += r.dead_letter_records;
                e.filter_bytes += r.filter_bytes;
                e.index_bytes += r.index_bytes;
            }
        }
        Ok(LedgerReport {
            data_dir: self.data_dir.clone(),
            format_version: FORMAT_VERSION,
            shards: self.shards.len(),
            file_bytes: dir_bytes(&self.data_dir),
            subscribers: by_name.into_values().collect(),
        })
    }

    /// A subscriber's handler state (all shards), in key order within each shard.
    pub fn state_entries(&self, subscriber: &str) -> Result<Vec<StateEntry>, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let mut all = Vec::new();
        for i in 0..self.shards.len() {
            let (tx, rx) = bounded(1);
            self.control(
                i,
                Control::StateEntries {
                    subscriber: sub.name.clone(),
                    reply: tx,
                },
            )?;
            all.extend(
                rx.recv()
                    .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))??,
            );
        }
        all.sort();
        Ok(all)
    }

    /// How many handler state entries a subscriber has (all shards).
    pub fn state_len(&self, subscriber: &str) -> Result<u64, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let mut total = 0;
        for i in 0..self.shards.len() {
            let (tx, rx) = bounded(1);
            self.control(
                i,
                Control::StateLen {
                    subscriber: sub.name.clone(),
                    reply: tx,
                },
            )?;
            total += rx
                .recv()
                .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))??;
        }
        Ok(total)
    }

    /// Snapshot of each shard's commit metrics.
    pub fn metrics(&self) -> Vec<ShardMetrics> {
        self.metrics
            .iter()
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .collect()
    }

    fn control(&self, shard: usize, c: Control) -> Result<(), LedgerError> {
        self.shards[shard]
            .tx
            .send(ShardMsg::Control(c))
            .map_err(|_| LedgerError::Poisoned("shard writer stopped".into()))
    }

    /// Stops accepting work, lets every shard finish what it was sent, and joins them.
    /// Returns the poison error if a shard failed.
    pub fn close(self) -> Result<(), LedgerError> {
        self.shutdown();
        match self.poison_reason() {
            Some(r) => Err(LedgerError::Poisoned(r)),
            None => Ok(()),
        }
    }

    fn shutdown(&self) {
        for s in &self.shards {
            let _ = s.tx.send(ShardMsg::Stop);
        }
        for s in &self.shards {
            // A poisoned or stopped shard has dropped its receiver; the send above failed.
            let handle = s.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(t) = handle {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Arms the injected storage fault of [`Ledger::open_with_fault_switch`].
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct FaultSwitch(Arc<std::sync::atomic::AtomicI64>);

impl FaultSwitch {
    /// From now on, `fsyncs` more fsyncs succeed (across all shards); then storage fails.
    pub fn fail_after_fsyncs(&self, fsyncs: u64) {
        self.0.store(fsyncs as i64, Ordering::SeqCst);
    }
}

/// Sum of the sizes of the files in a directory (not recursive).
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The text of a panic's payload, for an error message.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

fn shard_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("shard-{index:03}.redb"))
}

/// A shard file may only be created in the open that creates the manifest: one missing
/// later is a lost file, and recreating it empty would forget its claims without a word.
fn require_shard_files(dir: &Path, shards: usize) -> Result<(), LedgerError> {
    for index in 0..shards {
        let path = shard_path(dir, index);
        match std::fs::symlink_metadata(&path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LedgerError::MissingShard { path })
            }
            Err(e) => {
                return Err(LedgerError::DataDir {
                    path: dir.to_path_buf(),
                    detail: format!("cannot check {}: {e}", path.display()),
                })
            }
        }
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Creates the directory and manifest on first use; checks them afterwards. Returns the
/// shard count that is in force for this directory, and whether this call created the
/// manifest (only then may shard files be created).
fn prepare_data_dir(dir: &Path, cfg: &LedgerConfig) -> Result<(usize, bool), LedgerError> {
    let fail = |detail: String| LedgerError::DataDir {
        path: dir.to_path_buf(),
        detail,
    };
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(|e| fail(e.to_string()))?;
        // The new directory's own entry, durable with the files about to go in it.
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent).map_err(|e| fail(e.to_string()))?;
        }
    }
    let path = dir.join(MANIFEST);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| LedgerError::Corrupt {
                path: path.clone(),
                detail: format!("manifest is not readable: {e}"),
            })?;
            if m.format_version > FORMAT_VERSION {
                return Err(LedgerError::NewerFormat {
                    path: dir.to_path_buf(),
                    found: m.format_version,
                    supported: FORMAT_VERSION,
                });
            }
            if let Some(want) = cfg.shards {
                if want.get() != m.shards {
                    return Err(LedgerError::ShardCountMismatch {
                        path: dir.to_path_buf(),
                        found: m.shards,
                        configured: want.get(),
                    });
                }
            }
            if m.shards == 0 || m.shards > 256 {
                return Err(LedgerError::Corrupt {
                    path,
                    detail: format!("manifest names {} shards", m.shards),
                });
            }
            if m.format_version < FORMAT_VERSION {
                // The shards upgrade themselves on open (their own meta says which format
                // they hold); the manifest is bumped first so an older binary refuses the
                // directory from now on.
                tracing::warn!(data_dir = %dir.display(), from = m.format_version, to = FORMAT_VERSION,
                    "upgrading the data directory's format; older dedupd binaries will refuse it");
                write_manifest(
                    dir,
                    &Manifest {
                        format_version: FORMAT_VERSION,
                        shards: m.shards,
                    },
                )
                .map_err(|e| fail(e.to_string()))?;
            }
            Ok((m.shards, false))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let has_shards = std::fs::read_dir(dir)
                .map_err(|e| fail(e.to_string()))?
                .filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().starts_with("shard-"));
            if has_shards {
                return Err(LedgerError::Corrupt {
                    path,
                    detail: "shard files exist but the manifest is missing".into(),
                });
            }
            let shards = cfg.shards.map(|n| n.get()).unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            });
            let m = Manifest {
                format_version: FORMAT_VERSION,
                shards,
            };
            write_manifest(dir, &m).map_err(|e| fail(e.to_string()))?;
            Ok((shards, true))
        }
        Err(e) => Err(fail(e.to_string())),
    }
}

/// Replaces the manifest atomically and durably (temporary file, fsync, rename, fsync of
/// the directory).
fn write_manifest(dir: &Path, m: &Manifest) -> std::io::Result<()> {
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let body = serde_json::to_vec_pretty(m).map_err(std::io::Error::other)?;
    write_durably(&tmp, &body)?;
    std::fs::rename(&tmp, dir.join(MANIFEST))?;
    sync_dir(dir)
}

fn write_durably(path: &Path, body: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(body)?;
    f.sync_all()
}
