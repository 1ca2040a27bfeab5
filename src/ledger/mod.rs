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
//!
//! Where things are, in the order a message meets them:
//!
//! - `mod.rs`: [`Ledger`] (open, route, submit, lookup, close); `opening.rs`: what a
//!   shard reports while it opens (redb's repair, log replay), for `inspect --repair`;
//! - `job.rs`: one message on its way: [`Job`], [`Outcome`], [`Done`], [`Origin`];
//! - `format/`: the on-disk layout: every redb table (`tables.rs`), the data directory,
//!   its manifest and format upgrade on open (`datadir.rs`);
//! - `registry.rs`: subscribers, their settings, counters and the key source of their
//!   claims;
//! - `placement/`: which shard decides a message, probes between shards (I6), and
//!   `presence.rs`: what each shard publishes of its claims so most keys need no probe;
//! - `shard/`: one writer thread per shard file: `open`, `decide`, `probe`, `write`,
//!   `maintain` (seal, expire, the gaps between batches), `merge`, `control` (requests
//!   answered between batches), `breaker`, `share`;
//! - `claims/`: claim generations, the blocks of sealed ones, their filters, the stored
//!   claim;
//! - `state/`: handler state (buffer, state log, sorted runs, covers, read view, upgrade);
//! - `changelog.rs`: what a shard hands a subscriber's changelog before it commits (I7);
//! - `records/`: quarantine and dead-letter records, and the outbox (`outbox.rs`);
//! - `ops/`: operator operations by what they act on (claims and settings, records,
//!   outbox, backup);
//! - `report.rs`, `usage.rs`: `inspect` counts, shard metrics, bytes per kind of table;
//!   `offline.rs`: the read-only look at a closed directory;
//! - `poison.rs`: the fail-stop switch (G7);
//! - `backends/`: what sits under a shard file: `tracked.rs`, the writes recorded while an
//!   online backup copies it, and `fault.rs`, test fault injection; and `naive.rs`, the
//!   bench's baseline store.

mod backends;
pub mod changelog;
pub mod claims;
mod format;
mod job;
mod offline;
mod opening;
mod ops;
mod placement;
mod poison;
mod records;
mod registry;
mod report;
mod shard;
mod state;
mod usage;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::clock::Clock;
use crate::config::Config;
use crate::effects::HandlerFactory;
use crate::effects::StateEntry;
pub(crate) use backends::naive::NaiveBaseline;
pub use backends::naive::NaiveError;
pub use claims::record::{ClaimRecord, FORMAT_VERSION};
pub(crate) use format::datadir::{
    create_private_dir_all, dir_allocated_bytes, dir_bytes, private_file, read_manifest,
    shard_path, sync_dir, tree_bytes, AUDIT_LOG, HANDLERS_DIR, MANIFEST,
};
pub use job::{AckSender, Done, Job, Origin, Outcome, Work};
pub use offline::{close_copied_shard, hold_closed_shards, offline_report, ClosedShards};
pub(crate) use opening::REPLAY_EVERY;
pub use opening::{OpenObserver, OpenProgress};
pub(crate) use ops::ShardCopy;
pub use ops::StoredRecord;
pub use ops::{OutboxRelayGuard, OutboxRow, RecordKind};
pub(crate) use placement::{entity_scope, Placement};
pub(crate) use poison::PoisonHook;
pub(crate) use records::StoredPayload;
pub(crate) use registry::Registry;
pub(crate) use registry::{Subscriber, SubscriberCounters, SubscriberId, HANDLER_FAILURE_KINDS};
pub(crate) use report::LedgerReport;
pub use report::{ShardMetrics, SubscriberReport};
use shard::{Control, PeerMsg, ShardMsg};
#[cfg(test)]
pub(crate) use usage::TableGroup;
pub(crate) use usage::{disk_usage, DiskUsage};

/// A key source as shards record it with the claims made by it (`key_sources_v1`).
pub(crate) fn key_source_text(key: &crate::config::KeySource) -> String {
    serde_json::to_string(key).unwrap_or_else(|_| format!("{key:?}"))
}

/// Refuses `key` for `sub` while it has live claims made with another key source.
pub(crate) fn check_key_source(
    sub: &Subscriber,
    key: &crate::config::KeySource,
    now_ms: u64,
) -> Result<(), LedgerError> {
    let configured = key_source_text(key);
    let Some((stored, until)) = sub.live_claims_of_another_key_source(&configured, now_ms) else {
        return Ok(());
    };
    Err(LedgerError::KeySourceChanged {
        subscriber: sub.name.to_string(),
        stored: stored.to_string(),
        configured,
        until: humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(until),
        )
        .to_string(),
    })
}

/// A wall clock this far ahead of the last committed engine time is worth a warning.
const CLOCK_AHEAD_WARN_MS: u64 = 86_400_000;

/// Starts engine time at the newest time any shard committed (`engine_time_ms` in
/// `meta_v1`, written with every commit) when the clock is behind it, and says so: a run
/// whose clock is behind would otherwise store claims that expire early. A clock far ahead
/// is logged too: claims then expire as if that time had passed (irreversible).
fn start_at_time_mark(data_dir: &Path, floor: &crate::clock::FloorClock, mark: u64) {
    if mark == 0 {
        return;
    }
    let now = floor.now_ms();
    if let Some(behind) = floor.raise_to(mark) {
        tracing::warn!(data_dir = %data_dir.display(), behind_ms = behind, engine_time_ms = mark,
            "the system clock is behind the engine time this data directory last committed; engine time starts from that time instead (claims would otherwise expire early), and advances from it");
    } else if now - mark > CLOCK_AHEAD_WARN_MS {
        tracing::warn!(data_dir = %data_dir.display(), ahead_ms = now - mark, engine_time_ms = mark,
            "the system clock is more than a day ahead of the engine time this data directory last committed; if dedupd was not stopped that long, the clock is wrong and claims expire as if that time had passed");
    }
}

/// What a caller should do about a ledger error is in its text; every variant is fatal for
/// acking: after one, nothing more is acknowledged (G7).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    #[error("data directory {path} is in use by another dedupd process; stop it or use another --data-dir")]
    InUse { path: PathBuf },
    /// A read-only look (`inspect`) cannot use the files as they are.
    #[error("{path} cannot be read without writing: {detail}; `dedupd run` repairs or upgrades it when it starts, or `dedupd inspect --repair` opens it for writing first")]
    NeedsRepair { path: PathBuf, detail: String },
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
    /// A shard file that is there but empty (zero bytes, or a store with no dedupd data in
    /// it): treating it as a new shard would forget every claim it held.
    #[error("shard file {path} {detail} although the manifest names it; using it as an empty shard would forget every claim it held. Restore it from a backup (or, if this data directory never acknowledged anything, remove the directory)")]
    EmptyShard { path: PathBuf, detail: String },
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
    #[error("the changelog of subscriber {subscriber:?} did not take a batch: {detail}. Nothing of the batch was committed or acknowledged and the ledger stopped; restart dedupd once the changelog topic is reachable (the next owner of the partitions restores what was published)")]
    Changelog { subscriber: String, detail: String },
    /// A subscriber's key source differs from the one its live claims were made with: the
    /// same message would get another key and be processed again.
    #[error("subscriber {subscriber:?} has claims made with key source {stored} that live until {until}, and its key source would now be {configured}: every redelivery would get another key and be processed again. Keep the old key source, or give the new one a new subscriber name (or wait until its claims expired, or `forget` them)")]
    KeySourceChanged {
        subscriber: String,
        stored: String,
        configured: String,
        until: String,
    },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
}

struct ShardHandle {
    tx: Sender<ShardMsg>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The shard's file for read transactions that need not wait for its writer (record
    /// pages); empty if it failed to open. Weak: the file closes when its writer stops.
    reader: std::sync::Weak<redb::Database>,
}

/// A shard whose writer thread runs but may not have finished opening its file.
struct StartingShard {
    handle: ShardHandle,
    ready: Receiver<Result<Arc<redb::Database>, LedgerError>>,
    metrics: Arc<Mutex<ShardMetrics>>,
}

impl StartingShard {
    /// Starts the writer thread of one shard; returns it and the sender of its peer
    /// channel.
    fn spawn(
        data_dir: &Path,
        ctx: shard::ShardContext,
    ) -> Result<(StartingShard, Sender<PeerMsg>), LedgerError> {
        let (tx, rx) = bounded::<ShardMsg>(64);
        // Unbounded: a shard never blocks sending a probe or a reply, so two shards
        // asking each other cannot deadlock. Bounded by the messages in flight.
        let (peer_tx, peer_rx) = crossbeam_channel::unbounded::<PeerMsg>();
        let (ready_tx, ready) = bounded(1);
        let metrics = ctx.metrics.clone();
        let thread =
            shard::spawn(ctx, rx, peer_rx, ready_tx).map_err(|e| LedgerError::DataDir {
                path: data_dir.to_path_buf(),
                detail: format!("cannot start shard thread: {e}"),
            })?;
        let handle = ShardHandle {
            tx,
            thread: Mutex::new(Some(thread)),
            reader: std::sync::Weak::new(),
        };
        Ok((
            StartingShard {
                handle,
                ready,
                metrics,
            },
            peer_tx,
        ))
    }

    /// Waits until every shard finished opening (or failed to); returns the shards, their
    /// metrics and the first failure.
    fn wait_all(
        data_dir: &Path,
        starting: Vec<StartingShard>,
    ) -> (
        Vec<ShardHandle>,
        Vec<Arc<Mutex<ShardMetrics>>>,
        Option<LedgerError>,
    ) {
        let mut shards = Vec::with_capacity(starting.len());
        let mut metrics = Vec::with_capacity(starting.len());
        let mut first_err = None;
        for mut s in starting {
            match s.ready.recv() {
                Ok(Ok(db)) => s.handle.reader = Arc::downgrade(&db),
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
            shards.push(s.handle);
            metrics.push(s.metrics);
        }
        (shards, metrics, first_err)
    }
}

/// The engine's storage: shards, routing and the subscriber registry.
pub struct Ledger {
    data_dir: PathBuf,
    shards: Vec<ShardHandle>,
    registry: Arc<Registry>,
    poison: Arc<poison::Poison>,
    metrics: Vec<Arc<Mutex<ShardMetrics>>>,
    clock: Arc<dyn Clock>,
    /// A Kafka relay consumes the outbox (`ops/outbox.rs`).
    outbox_relay: std::sync::atomic::AtomicBool,
    /// Bumped to make the relay look at the outbox now instead of after its poll interval.
    outbox_wakes: std::sync::atomic::AtomicU64,
    /// One online backup at a time: each shard records its writes for one copy.
    backup: Mutex<()>,
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
        Ledger::open_inner(data_dir, config, clock, None, None)
    }

    /// [`Ledger::open`], telling `observer` what each shard does while it opens (redb's
    /// repair of a file not closed cleanly, loading, replaying logs): an open after a kill
    /// can take long, and `dedupd inspect --repair` shows how far it is.
    pub(crate) fn open_observed(
        data_dir: &Path,
        config: &Config,
        clock: Arc<dyn Clock>,
        observer: OpenObserver,
    ) -> Result<Ledger, LedgerError> {
        Ledger::open_inner(data_dir, config, clock, None, Some(observer))
    }

    /// Like [`Ledger::open`], with a switch that makes every shard file fail all writes
    /// and fsyncs, or lose its power, after a chosen number of further fsyncs. For
    /// crash-consistency tests.
    #[doc(hidden)]
    pub fn open_with_fault_switch(
        data_dir: &Path,
        config: &Config,
        clock: Arc<dyn Clock>,
    ) -> Result<(Ledger, FaultSwitch), LedgerError> {
        let switch = FaultSwitch::new();
        let ledger = Ledger::open_with_faults(data_dir, config, clock, &switch)?;
        Ok((ledger, switch))
    }

    /// Opens a ledger whose storage goes through `faults`, which may already be armed, so
    /// a fault can land while the shards open and recover. Only for tests.
    #[doc(hidden)]
    pub fn open_with_faults(
        data_dir: &Path,
        config: &Config,
        clock: Arc<dyn Clock>,
        faults: &FaultSwitch,
    ) -> Result<Ledger, LedgerError> {
        Ledger::open_inner(data_dir, config, clock, Some(faults.0.clone()), None)
    }

    fn open_inner(
        data_dir: &Path,
        config: &Config,
        clock: Arc<dyn Clock>,
        fault: Option<Arc<backends::fault::FaultPlan>>,
        observer: Option<OpenObserver>,
    ) -> Result<Ledger, LedgerError> {
        let (shard_count, created) = format::datadir::prepare_data_dir(data_dir, &config.ledger)?;
        if !created {
            format::datadir::require_shard_files(data_dir, shard_count)?;
        }
        // Engine time never starts below what the directory last committed (raised below,
        // once every shard read its mark).
        let floor = Arc::new(crate::clock::FloorClock::new(clock));
        let clock: Arc<dyn Clock> = floor.clone();
        let time_mark = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let registry = Arc::new(Registry::new(config.clone()));
        let poison = Arc::new(poison::Poison::default());
        let builder = claims::generation::Builder::spawn();
        let peers: Arc<std::sync::OnceLock<Vec<Sender<PeerMsg>>>> = Default::default();
        let inflight = Arc::new(placement::InFlight::default());
        let presences = Arc::new(placement::presence::Presences::new(shard_count));
        let engine_commits = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut peer_txs = Vec::with_capacity(shard_count);
        let mut starting = Vec::with_capacity(shard_count);
        for index in 0..shard_count {
            let ctx = shard::ShardContext {
                path: format::datadir::shard_path(data_dir, index),
                index,
                count: shard_count,
                config: config.ledger.clone(),
                registry: registry.clone(),
                clock: clock.clone(),
                poison: poison.clone(),
                metrics: Arc::new(Mutex::new(ShardMetrics::default())),
                builder: builder.clone(),
                fault: fault.clone(),
                peers: peers.clone(),
                inflight: inflight.clone(),
                presences: presences.clone(),
                writes: Default::default(),
                engine_commits: engine_commits.clone(),
                create: created,
                time_mark: time_mark.clone(),
                observer: observer.clone(),
            };
            let (shard, peer_tx) = StartingShard::spawn(data_dir, ctx)?;
            peer_txs.push(peer_tx);
            starting.push(shard);
        }
        // Set before any shard can receive a job: `open` has not returned yet.
        let _ = peers.set(peer_txs);
        let (shards, metrics, mut first_err) = StartingShard::wait_all(data_dir, starting);
        if first_err.is_none() {
            start_at_time_mark(data_dir, &floor, time_mark.load(Ordering::SeqCst));
            let now = floor.now_ms();
            first_err = registry
                .all()
                .iter()
                .find_map(|sub| check_key_source(sub, &sub.settings().key, now).err());
        }
        let ledger = Ledger {
            data_dir: data_dir.to_path_buf(),
            shards,
            registry,
            poison,
            metrics,
            clock,
            outbox_relay: Default::default(),
            outbox_wakes: Default::default(),
            backup: Mutex::new(()),
        };
        if first_err.is_none() && created {
            // The new shard files' directory entries, durable before anything is acked.
            first_err = format::datadir::sync_dir(data_dir)
                .map_err(|e| LedgerError::DataDir {
                    path: data_dir.to_path_buf(),
                    detail: format!("cannot sync the directory after creating shard files: {e}"),
                })
                .err();
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

    /// Looks up or registers a subscriber by name.
    pub fn subscriber(&self, name: &str) -> Result<Arc<Subscriber>, LedgerError> {
        self.registry.resolve(name, false)
    }

    /// Whether subscriber `name` is configured or has anything stored here; registers
    /// nothing.
    pub(crate) fn knows_subscriber(&self, name: &str) -> bool {
        self.registry.known(name)
    }

    /// The settings of subscriber `name`, registered or not; registers nothing. Refuses a
    /// name the config does not allow.
    pub(crate) fn settings_of(
        &self,
        name: &str,
    ) -> Result<Arc<crate::config::SubscriberSettings>, LedgerError> {
        self.registry.settings_of(name)
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

    /// Installs (or removes) the sink a subscriber's shards publish their processed
    /// messages' claims and state to before each commit (`changelog.rs`); shards pick it
    /// up between batches.
    pub fn set_changelog(
        &self,
        subscriber: &str,
        sink: Option<Arc<dyn changelog::ChangelogSink>>,
    ) -> Result<(), LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let mut slot = sub.changelog.write().unwrap_or_else(|p| p.into_inner());
        sub.has_changelog.store(sink.is_some(), Ordering::Release);
        *slot = sink;
        Ok(())
    }

    /// The handler for subscribers that take `[defaults]`, now and when they first appear.
    pub(crate) fn set_default_handler(&self, handler: Option<Arc<dyn HandlerFactory>>) {
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
    pub(crate) fn subscribers(&self) -> Vec<Arc<Subscriber>> {
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
    pub(crate) fn on_poison(&self, hook: PoisonHook) {
        self.poison.on_set(hook);
    }

    /// The newest claim for `(subscriber, key)`, live or expired, or `None`. Asks every
    /// shard: a claim lives where its message was decided, which depends on the placement
    /// in force then (`placement.rs`); the newest record across shards wins (I2).
    pub fn lookup(&self, subscriber: &str, key: u128) -> Result<Option<ClaimRecord>, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let found = self.ask_all(|reply| Control::Lookup {
            sub: sub.id,
            key,
            reply,
        })?;
        let newest = found.into_iter().fold(None, ClaimRecord::newer);
        Ok(newest.filter(|r| !r.is_tombstone()))
    }

    /// Seals every active generation (when `seal_all`), then runs sealing, merging and
    /// expiry until no such work is left. Each step is its own durable commit.
    pub fn maintain(&self, seal_all: bool) -> Result<(), LedgerError> {
        self.ask_all(|reply| Control::Maintain { seal_all, reply })?;
        Ok(())
    }

    /// A subscriber's handler state (all shards), in key order within each shard.
    pub fn state_entries(&self, subscriber: &str) -> Result<Vec<StateEntry>, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let mut all: Vec<StateEntry> = self
            .ask_all(|reply| Control::StateEntries {
                subscriber: sub.name.clone(),
                reply,
            })?
            .into_iter()
            .flatten()
            .collect();
        all.sort();
        Ok(all)
    }

    /// How many handler state entries a subscriber has (all shards).
    pub fn state_len(&self, subscriber: &str) -> Result<u64, LedgerError> {
        let sub = self.registry.resolve(subscriber, true)?;
        let counts = self.ask_all(|reply| Control::StateLen {
            subscriber: sub.name.clone(),
            reply,
        })?;
        Ok(counts.into_iter().sum())
    }

    /// Stops accepting work, lets every shard finish what it was sent, and joins them.
    /// Returns the poison error if a shard failed.
    pub fn close(self) -> Result<(), LedgerError> {
        self.stop()
    }

    /// Stops every shard and closes its file cleanly, like [`Ledger::close`], while other
    /// parts may still hold the ledger (a stdin reader blocked on input, say): what they
    /// submit afterwards fails, and nothing more is acknowledged. A clean exit stops the
    /// ledger one way or the other, so `inspect` and offline backups take the directory.
    pub(crate) fn stop(&self) -> Result<(), LedgerError> {
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
pub struct FaultSwitch(Arc<backends::fault::FaultPlan>);

impl Default for FaultSwitch {
    fn default() -> Self {
        FaultSwitch::new()
    }
}

impl FaultSwitch {
    /// A switch with nothing armed, for [`Ledger::open_with_faults`].
    pub fn new() -> FaultSwitch {
        FaultSwitch(Arc::new(backends::fault::FaultPlan::new()))
    }

    /// From now on, `fsyncs` more fsyncs succeed (across all shards); then storage fails,
    /// keeping what was written (as a dying disk under a live page cache would).
    pub fn fail_after_fsyncs(&self, fsyncs: u64) {
        self.0.arm(fsyncs, backends::fault::FaultKind::FailDisk, 1);
    }

    /// From now on, `fsyncs` more fsyncs succeed; then the power is cut: every write since
    /// a file's last completed fsync is lost except a random half (drawn from `seed`),
    /// and storage answers nothing more.
    pub fn cut_power_after_fsyncs(&self, fsyncs: u64, seed: u64) {
        self.0
            .arm(fsyncs, backends::fault::FaultKind::PowerCut, seed);
    }

    /// As [`cut_power_after_fsyncs`](Self::cut_power_after_fsyncs), and the newest
    /// unsynced write is kept half-written: a torn write.
    pub fn tear_a_write_after_fsyncs(&self, fsyncs: u64, seed: u64) {
        self.0
            .arm(fsyncs, backends::fault::FaultKind::TornWrite, seed);
    }

    /// From now on, `fsyncs` more fsyncs succeed; then the disk is full: every write that
    /// needs new blocks (past what a file ever held) fails with `ENOSPC` (os error 28);
    /// writes in place and fsyncs work.
    pub fn fill_disk_after_fsyncs(&self, fsyncs: u64) {
        self.0.arm(fsyncs, backends::fault::FaultKind::DiskFull, 1);
    }

    /// From now on, `reads` more reads succeed (across all shards); then every read fails
    /// with `EIO` (os error 5), as an unreadable sector would.
    pub fn fail_reads_after(&self, reads: u64) {
        self.0.fail_reads_after(reads);
    }

    /// Completed fsyncs so far, over all shard files.
    pub fn fsyncs(&self) -> u64 {
        self.0.fsyncs()
    }

    /// Reads that reached the shard files so far (failed ones included).
    pub fn reads(&self) -> u64 {
        self.0.reads()
    }

    /// Unsynced writes the power cuts lost so far, over all shard files.
    pub fn lost_writes(&self) -> u64 {
        self.0.lost_writes()
    }
}

/// The text of a panic's payload, for an error message.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod origin_tests {
    use super::Origin;

    #[test]
    fn an_origin_reads_as_records_name_it() {
        let k = Origin::Kafka {
            topic: "orders".into(),
            partition: 3,
            offset: 1234,
        };
        assert_eq!(k.to_string(), "kafka:orders/3/1234");
        assert_eq!(Origin::from("http").to_string(), "http");
        assert_eq!(
            Origin::from(String::from("kafka:t/0/7")).to_string(),
            "kafka:t/0/7"
        );
        let n = Origin::Nats {
            stream: "ORDERS".into(),
            sequence: 42,
        };
        assert_eq!(n.to_string(), "nats:ORDERS/42");
        assert_eq!(n.kafka_partition(), None);
    }

    #[test]
    fn the_kafka_partition_is_read_from_live_and_stored_origins() {
        let k = Origin::Kafka {
            topic: "orders".into(),
            partition: 3,
            offset: 1234,
        };
        assert_eq!(k.kafka_partition(), Some(3));
        for (text, want) in [
            ("kafka:orders/3/1234", Some(3)),
            ("kafka:a/b.c/0/7", Some(0)), // topic names may hold neither '/' nor ':', but be safe
            ("kafka:orders/x/1", None),
            ("kafka:orders/-1/1", None),
            ("kafka:/3/1", None),
            ("kafka:3/1", None),
            ("http", None),
            ("", None),
        ] {
            assert_eq!(Origin::from(text).kafka_partition(), want, "{text}");
        }
    }
}
