//! One shard: a redb file and the writer thread that owns it.
//!
//! Invariants (named in `docs/design.md`):
//! - **I1 commit before release**: outcomes of a batch are sent only after its transaction
//!   committed with `Durability::Immediate`; a batch that wrote nothing needs no commit
//!   because every claim it read was committed by an earlier batch (or failed the shard).
//! - **I2 newest record wins**: lookups go active -> sealing -> sealed (newest first); the
//!   first record found for a key decides, live or expired.
//! - **I3 log until sealed**: a generation's log table is deleted in the same transaction
//!   that commits its sorted table, filter and `Sealed` row.
//! - **I4 fail-stop**: after any storage error, or a panic on the writer thread, the shard
//!   answers `Failed` to everything and never commits again (G7).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
    TableHandle, WriteTransaction,
};

use super::filter::GenFilter;
use super::generation::{
    merge_slice, ActiveGen, BuildJob, Builder, Built, Found, KeyMap, MergeJob, SealedGen,
    SealingGen, SubState,
};
use super::handlers::{self, BatchView, ShardHandler, StateBuffer};
use super::placement::{self, Acquire, InFlight, Placement};
use super::record::{ClaimRecord, GenMeta, GenState, LogRow, CLAIM_LEN, FORMAT_VERSION};
use super::records::{self, PendingRecord};
use super::tables::{self, ClaimsTable, LogTable};
use super::{
    Done, Job, LedgerError, Outcome, RecordKind, Registry, ShardMetrics, SubscriberId,
    SubscriberReport,
};
use crate::clock::Clock;
use crate::config::LedgerConfig;
use crate::effects::StateEntry;
use crate::effects::{Effects, Failure, HandlerMessage, MessageHandler, StateReader};

/// A stored row and its sequence number.
pub(crate) type SeqRow = (u64, Vec<u8>);

pub(crate) enum ShardMsg {
    Jobs(Vec<Job>),
    Control(Control),
    Stop,
}

/// Messages between shards (`placement.rs`): a probe for claims of keys another shard is
/// about to decide, and its answer. Answered between batches, so only committed claims
/// are reported.
pub(crate) enum PeerMsg {
    Probe {
        from: usize,
        group: u64,
        keys: Vec<(SubscriberId, u128)>,
    },
    Reply {
        group: u64,
        found: Result<Vec<Option<ClaimRecord>>, LedgerError>,
    },
}

/// Jobs waiting for the other shards' answers to one probe.
struct ProbeGroup {
    jobs: Vec<Job>,
    outstanding: usize,
    found: Vec<Option<ClaimRecord>>,
    failed: Option<LedgerError>,
}

pub(crate) enum Control {
    /// Answered between two batches: a barrier (see `Ledger::prepare_placement`).
    Sync { reply: Sender<()> },
    /// The newest record of the key in this shard, tombstones included.
    Lookup {
        sub: SubscriberId,
        key: u128,
        reply: Sender<Result<Option<ClaimRecord>, LedgerError>>,
    },
    Maintain {
        seal_all: bool,
        reply: Sender<Result<(), LedgerError>>,
    },
    Report {
        reply: Sender<Result<Vec<SubscriberReport>, LedgerError>>,
    },
    StateEntries {
        subscriber: Arc<str>,
        reply: Sender<Result<Vec<StateEntry>, LedgerError>>,
    },
    StateLen {
        subscriber: Arc<str>,
        reply: Sender<Result<u64, LedgerError>>,
    },
    Forget {
        sub: SubscriberId,
        key: u128,
        reply: Sender<Result<bool, LedgerError>>,
    },
    Records {
        kind: RecordKind,
        subscriber: Arc<str>,
        /// First sequence number to return.
        from: u64,
        limit: usize,
        reply: Sender<Result<Vec<SeqRow>, LedgerError>>,
    },
    DeleteRecord {
        kind: RecordKind,
        sub: SubscriberId,
        seq: u64,
        reply: Sender<Result<bool, LedgerError>>,
    },
    AddDeadLetter {
        sub: SubscriberId,
        row: PendingRecord,
        reply: Sender<Result<u64, LedgerError>>,
    },
    OutboxPending {
        limit: usize,
        reply: Sender<Result<Vec<SeqRow>, LedgerError>>,
    },
    OutboxAck {
        seqs: Vec<u64>,
        reply: Sender<Result<(), LedgerError>>,
    },
    Backup {
        dest: PathBuf,
        reply: Sender<Result<u64, LedgerError>>,
    },
}

pub(crate) struct ShardContext {
    pub path: PathBuf,
    pub index: usize,
    pub count: usize,
    pub config: LedgerConfig,
    pub registry: Arc<Registry>,
    pub clock: Arc<dyn Clock>,
    pub poison: Arc<Mutex<Option<String>>>,
    pub poisoned: Arc<AtomicBool>,
    pub metrics: Arc<Mutex<ShardMetrics>>,
    pub builder: Builder,
    /// Test-only fault injection (see `fault.rs`).
    pub fault: Option<Arc<std::sync::atomic::AtomicI64>>,
    /// Every shard's peer channel, by index (set before `Ledger::open` returns).
    pub peers: Arc<std::sync::OnceLock<Vec<Sender<PeerMsg>>>>,
    /// Keys being decided with a probe, shared by all shards.
    pub inflight: Arc<InFlight>,
}

pub(crate) struct Shard {
    ctx: ShardContext,
    db: Arc<Database>,
    subs: Vec<Option<SubState>>,
    next_table_id: u64,
    next_quarantine_seq: u64,
    built_tx: Sender<Built>,
    built_rx: Receiver<Built>,
    last_expiry_check_ms: u64,
    batch: Vec<Job>,
    quarantine_rows: Vec<PendingRecord>,
    failed: Option<LedgerError>,
    /// Emptied indexes of sealed generations, reused for new active generations. First
    /// touches of a fresh half-million-entry table cost 100-200 ms of page faults on this
    /// VM (measured); a recycled table is already resident.
    spare_maps: Vec<KeyMap>,
    map_requested: bool,
    /// Log tables of sealed generations, emptied a few rows per batch. A crash leaves them
    /// as orphans that `recover` deletes.
    retired_logs: std::collections::VecDeque<String>,
    /// Messages whose handler failed and that wait for their next attempt.
    retries: std::collections::BinaryHeap<Retry>,
    retry_order: u64,
    dead_rows: Vec<PendingRecord>,
    /// Records that replayed jobs of this batch settled, removed with its commit.
    settled: Vec<(RecordKind, SubscriberId, u64)>,
    next_outbox_seq: u64,
    next_dead_seq: u64,
    /// Scratch message handed to handlers, reused between calls.
    handler_msg: HandlerMessage,
    /// Probes sent to the other shards and the jobs waiting for their answers.
    probing: HashMap<u64, ProbeGroup>,
    next_group: u64,
}

/// A message waiting for its next attempt; the heap pops the earliest due first.
struct Retry {
    due: Instant,
    order: u64,
    job: Job,
}

impl PartialEq for Retry {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.order) == (other.due, other.order)
    }
}
impl Eq for Retry {}
impl PartialOrd for Retry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Retry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.due, other.order).cmp(&(self.due, self.order))
    }
}

/// What a batch decided for one job.
enum Decision {
    Done(Outcome),
    /// The handler failed retryably; try again after a backoff.
    Retry(Failure),
    /// No live claim here; the key is now held in flight: ask the other shards.
    Probe,
    /// Another job (here or on another shard) is deciding this key: try again shortly.
    Wait,
}

/// How soon a job that waits for another decision of its key is tried again.
const WAIT_FOR_KEY: Duration = Duration::from_millis(1);

/// Stands in for a handler whose instance cannot be created: every call fails, so the
/// messages are retried and dead-lettered instead of processed without their handler.
struct Unavailable(String);

impl MessageHandler for Unavailable {
    fn handle(
        &mut self,
        _msg: &HandlerMessage,
        state: Box<dyn StateReader>,
    ) -> (Box<dyn StateReader>, Result<Effects, Failure>) {
        (state, Err(Failure::Trap(self.0.clone())))
    }
}

/// Maps any redb error to a ledger error naming the file.
fn storage(path: &std::path::Path, e: impl Into<redb::Error>) -> LedgerError {
    match e.into() {
        redb::Error::DatabaseAlreadyOpen => LedgerError::InUse {
            path: path.parent().unwrap_or(path).to_path_buf(),
        },
        redb::Error::Corrupted(detail) => LedgerError::Corrupt {
            path: path.to_path_buf(),
            detail,
        },
        // A bad header (wrong magic number, impossible layout) is reported as invalid data.
        redb::Error::Io(e) if e.kind() == std::io::ErrorKind::InvalidData => LedgerError::Corrupt {
            path: path.to_path_buf(),
            detail: e.to_string(),
        },
        other => LedgerError::Storage {
            path: path.to_path_buf(),
            detail: other.to_string(),
        },
    }
}

fn claims_def(name: &str) -> ClaimsTable<'_> {
    TableDefinition::new(name)
}

fn log_def(name: &str) -> LogTable<'_> {
    TableDefinition::new(name)
}

/// Rows per slice of sealing/merging work inside a normal batch: at least twice the batch
/// so sealing outpaces the filling of the next generation, small enough to keep the batch
/// short.
fn slice_budget(batch_len: usize) -> usize {
    (batch_len * 2).max(8192)
}

const IDLE_SLICE: usize = 65_536;
/// Rows of a retired log removed per batch (each row is one earlier batch's claims).
const RETIRE_ROWS: usize = 4;
const EXPIRY_CHECK_MS: u64 = 1000;

struct Loaded {
    metas: Vec<(String, u64, GenMeta)>,
    tables: Vec<String>,
}

impl Shard {
    /// Opens or creates the shard file, checks its format, loads filters, replays logs and
    /// removes leftovers of interrupted sealing or merging. Nothing is accepted before this
    /// returns (G3).
    pub fn open(ctx: ShardContext) -> Result<Shard, LedgerError> {
        let path = ctx.path.clone();
        let err = |e: redb::Error| storage(&path, e);
        let mut builder = Database::builder();
        builder.set_cache_size(ctx.config.cache_mib.get() << 20);
        builder.set_check_integrity_on_open(ctx.config.verify_on_open);
        let db = match &ctx.fault {
            None => builder.create(&ctx.path).map_err(|e| storage(&path, e))?,
            Some(budget) => {
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&ctx.path)
                    .map_err(|e| storage(&path, redb::StorageError::Io(e)))?;
                let backend = super::fault::FaultyBackend::new(file, budget.clone())
                    .map_err(|e| storage(&path, e))?;
                builder
                    .create_with_backend(backend)
                    .map_err(|e| storage(&path, e))?
            }
        };
        let (built_tx, built_rx) = unbounded();
        let mut shard = Shard {
            db: Arc::new(db),
            subs: Vec::new(),
            next_table_id: 1,
            next_quarantine_seq: 1,
            built_tx,
            built_rx,
            last_expiry_check_ms: 0,
            batch: Vec::new(),
            quarantine_rows: Vec::new(),
            failed: None,
            spare_maps: Vec::new(),
            map_requested: false,
            retired_logs: Default::default(),
            retries: Default::default(),
            retry_order: 0,
            dead_rows: Vec::new(),
            settled: Vec::new(),
            next_outbox_seq: 1,
            next_dead_seq: 1,
            handler_msg: HandlerMessage::default(),
            probing: HashMap::new(),
            next_group: 0,
            ctx,
        };
        let mut txn = shard.db.begin_write().map_err(|e| err(e.into()))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| err(redb::Error::from(redb::StorageError::Backend(Box::new(e)))))?;
        let loaded = shard.check_meta_and_load(&txn)?;
        handlers::upgrade_v1_tables(&txn, &loaded.tables).map_err(|e| shard.err(e))?;
        shard.recover(&txn, loaded)?;
        txn.commit().map_err(|e| err(e.into()))?;
        Ok(shard)
    }

    fn err(&self, e: impl Into<redb::Error>) -> LedgerError {
        storage(&self.ctx.path, e)
    }

    fn corrupt(&self, detail: String) -> LedgerError {
        LedgerError::Corrupt {
            path: self.ctx.path.clone(),
            detail,
        }
    }

    fn check_meta_and_load(&mut self, txn: &WriteTransaction) -> Result<Loaded, LedgerError> {
        let mut meta = txn.open_table(tables::META).map_err(|e| self.err(e))?;
        let version = meta
            .get("format_version")
            .map_err(|e| self.err(e))?
            .map(|v| v.value());
        match version {
            None => {
                let index = self.ctx.index as u64;
                let count = self.ctx.count as u64;
                for (k, v) in [
                    ("format_version", FORMAT_VERSION),
                    ("shard_index", index),
                    ("shard_count", count),
                    ("next_table_id", 1),
                    ("next_quarantine_seq", 1),
                    ("next_outbox_seq", 1),
                    ("next_dead_seq", 1),
                ] {
                    meta.insert(k, v).map_err(|e| self.err(e))?;
                }
            }
            Some(v) if v > FORMAT_VERSION => {
                return Err(LedgerError::NewerFormat {
                    path: self.ctx.path.clone(),
                    found: v,
                    supported: FORMAT_VERSION,
                })
            }
            Some(_) => {
                let path = self.ctx.path.clone();
                let get = |k: &str| -> Result<u64, LedgerError> {
                    meta.get(k)
                        .map_err(|e| storage(&path, e))?
                        .map(|v| v.value())
                        .ok_or_else(|| LedgerError::Corrupt {
                            path: path.clone(),
                            detail: format!("meta key `{k}` is missing"),
                        })
                };
                let index = get("shard_index")?;
                let count = get("shard_count")?;
                if index != self.ctx.index as u64 || count != self.ctx.count as u64 {
                    return Err(self.corrupt(format!(
                        "file says it is shard {index} of {count}, expected {} of {}",
                        self.ctx.index, self.ctx.count
                    )));
                }
                self.next_table_id = get("next_table_id")?;
                self.next_quarantine_seq = get("next_quarantine_seq")?;
                self.next_outbox_seq = get("next_outbox_seq")?;
                self.next_dead_seq = get("next_dead_seq")?;
            }
        }
        let upgrade_from = version.filter(|v| *v < FORMAT_VERSION);
        if upgrade_from.is_some() {
            meta.insert("format_version", FORMAT_VERSION)
                .map_err(|e| self.err(e))?;
        }
        drop(meta);
        let gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        let mut metas = Vec::new();
        for row in gens.iter().map_err(|e| self.err(e))? {
            let (k, v) = row.map_err(|e| self.err(e))?;
            let (sub, id) = k.value();
            let m = GenMeta::decode(v.value())
                .map_err(|d| self.corrupt(format!("generation {sub}/{id}: {d}")))?;
            metas.push((sub.to_string(), id, m));
        }
        drop(gens);
        txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        txn.open_table(tables::QUARANTINE)
            .map_err(|e| self.err(e))?;
        let tables: Vec<String> = txn
            .list_tables()
            .map_err(|e| self.err(e))?
            .map(|h| h.name().to_string())
            .collect();
        let mut placements = txn
            .open_table(tables::PLACEMENTS)
            .map_err(|e| self.err(e))?;
        if let Some(from) = upgrade_from {
            // Format 1 routed by the configured partition key: a subscriber's claims may
            // be on any shard, and its handler state is not scoped to entities.
            let mut names: std::collections::BTreeSet<&str> =
                metas.iter().map(|(sub, _, _)| sub.as_str()).collect();
            names.extend(
                tables
                    .iter()
                    .filter_map(|t| handlers::state_table_subscriber(t)),
            );
            for name in &names {
                placements
                    .insert(*name, placement::ANYWHERE)
                    .map_err(|e| self.err(e))?;
            }
            tracing::warn!(shard = self.ctx.index, from, to = FORMAT_VERSION, subscribers = names.len(),
                "upgraded the shard's format: its subscribers' claims are now looked up on every shard");
        }
        for row in placements.iter().map_err(|e| self.err(e))? {
            let (name, mask) = row.map_err(|e| self.err(e))?;
            let spec = self.ctx.registry.resolve(name.value(), true)?;
            spec.placements.fetch_or(mask.value(), Ordering::AcqRel);
        }
        drop(placements);
        Ok(Loaded { metas, tables })
    }

    /// Rebuilds in-memory state from the generations table and deletes leftovers.
    fn recover(&mut self, txn: &WriteTransaction, loaded: Loaded) -> Result<(), LedgerError> {
        let now = self.ctx.clock.now_ms();
        let mut keep_claims = std::collections::HashSet::new();
        let mut keep_logs = std::collections::HashSet::new();
        let mut by_sub: std::collections::BTreeMap<String, Vec<(u64, GenMeta)>> =
            Default::default();
        for (sub, id, m) in loaded.metas {
            by_sub.entry(sub).or_default().push((id, m));
        }
        for (name, mut gens) in by_sub {
            let spec = self.ctx.registry.resolve(&name, true)?;
            gens.sort_by_key(|(_, m)| m.order);
            let mut st = new_sub_state(&spec, &self.db).map_err(|e| self.err(e))?;
            st.next_order = gens.last().map_or(1, |(_, m)| m.order + 1);
            let mut logs: Vec<(u64, GenMeta)> = Vec::new();
            for (id, m) in gens {
                match m.state {
                    GenState::Sealed => {
                        let filter = self.load_filter(txn, &name, id)?;
                        keep_claims.insert(tables::claims_name(&name, id));
                        st.sealed.push(SealedGen {
                            table_id: id,
                            order: m.order,
                            count: m.count,
                            max_expires_ms: m.max_expires_ms,
                            created_at_ms: m.created_at_ms,
                            filter,
                        });
                    }
                    GenState::Active | GenState::Sealing => {
                        keep_logs.insert(tables::log_name(&name, id));
                        logs.push((id, m));
                    }
                }
            }
            // The newest log generation stays active; older ones are sealed again as one.
            if let Some((id, m)) = logs.pop() {
                let (map, rows) = self.replay_log(txn, &name, &[id])?;
                st.active = Some(ActiveGen {
                    table_id: id,
                    order: m.order,
                    map,
                    next_row: rows,
                    created_at_ms: m.created_at_ms,
                });
            }
            if !logs.is_empty() {
                let ids: Vec<u64> = logs.iter().map(|(id, _)| *id).collect();
                let (map, _) = self.replay_log(txn, &name, &ids)?;
                let (last_id, last_meta) = logs[logs.len() - 1];
                let gen = SealingGen {
                    table_id: last_id,
                    order: last_meta.order,
                    created_at_ms: last_meta.created_at_ms,
                    map: Arc::new(map),
                    built: None,
                    pos: 0,
                    extra_logs: ids[..ids.len() - 1].to_vec(),
                };
                self.start_sealing(&mut st, gen, now);
                let mut gens_t = txn
                    .open_table(tables::GENERATIONS)
                    .map_err(|e| self.err(e))?;
                for (id, m) in &logs {
                    let sealing = GenMeta {
                        state: GenState::Sealing,
                        ..*m
                    };
                    gens_t
                        .insert((name.as_str(), *id), sealing.encode().as_slice())
                        .map_err(|e| self.err(e))?;
                }
            }
            let idx = spec.id.0 as usize;
            if self.subs.len() <= idx {
                self.subs.resize_with(idx + 1, || None);
            }
            self.subs[idx] = Some(st);
        }
        for name in loaded.tables {
            let orphan = (name.starts_with(tables::CLAIMS_PREFIX) && !keep_claims.contains(&name))
                || (name.starts_with(tables::LOG_PREFIX) && !keep_logs.contains(&name));
            if orphan {
                tracing::info!(shard = self.ctx.index, table = %name, "removing leftover of interrupted sealing or merging");
                txn.delete_table(claims_def(&name))
                    .map_err(|e| self.err(e))?;
            }
        }
        Ok(())
    }

    fn load_filter(
        &self,
        txn: &WriteTransaction,
        sub: &str,
        id: u64,
    ) -> Result<GenFilter, LedgerError> {
        let mut filters = txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        let stored = filters
            .get((sub, id))
            .map_err(|e| self.err(e))?
            .map(|v| GenFilter::decode(v.value()));
        match stored {
            Some(Ok(f)) => Ok(f),
            other => {
                // A lost or unreadable filter is rebuilt from the sorted table itself.
                tracing::warn!(shard = self.ctx.index, subscriber = sub, generation = id,
                    problem = ?other.and_then(|r| r.err()), "rebuilding generation filter");
                let name = tables::claims_name(sub, id);
                let t = txn.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
                let mut keys = Vec::new();
                for row in t.iter().map_err(|e| self.err(e))? {
                    keys.push(row.map_err(|e| self.err(e))?.0.value());
                }
                let f = GenFilter::build(keys.into_iter());
                filters
                    .insert((sub, id), f.encode().as_slice())
                    .map_err(|e| self.err(e))?;
                Ok(f)
            }
        }
    }

    /// Reads log tables in order into one map (later rows win). Returns the map and the
    /// row count of the last table.
    fn replay_log(
        &self,
        txn: &WriteTransaction,
        sub: &str,
        ids: &[u64],
    ) -> Result<(KeyMap, u64), LedgerError> {
        let mut map = KeyMap::default();
        let mut rows = 0;
        for id in ids {
            let name = tables::log_name(sub, *id);
            let t = txn.open_table(log_def(&name)).map_err(|e| self.err(e))?;
            rows = 0;
            for row in t.iter().map_err(|e| self.err(e))? {
                let (k, v) = row.map_err(|e| self.err(e))?;
                let entries = LogRow::decode(v.value())
                    .map_err(|d| self.corrupt(format!("log {name} row {}: {d}", k.value())))?;
                for (key, rec) in entries {
                    map.insert(key, rec);
                }
                rows = k.value() + 1;
            }
        }
        Ok((map, rows))
    }

    /// The writer loop. Returns when told to stop or when every sender is gone.
    pub fn run(mut self, rx: Receiver<ShardMsg>, peer_rx: Receiver<PeerMsg>) {
        let tick = Duration::from_millis(50);
        loop {
            let wait = match self.retries.peek() {
                Some(r) => r.due.saturating_duration_since(Instant::now()).min(tick),
                None => tick,
            };
            let msg = crossbeam_channel::select! {
                recv(rx) -> m => match m {
                    Ok(m) => Some(m),
                    Err(_) => break,
                },
                recv(peer_rx) -> m => {
                    if let Ok(m) = m {
                        self.peer(m);
                    }
                    None
                },
                default(wait) => {
                    self.take_due_retries();
                    if self.batch.is_empty() {
                        self.idle();
                    } else {
                        self.process_batch();
                    }
                    continue;
                }
            };
            let deferred = match msg {
                Some(ShardMsg::Jobs(jobs)) => {
                    self.take_due_retries();
                    self.batch.extend(jobs);
                    let deferred = self.gather(&rx);
                    self.process_batch();
                    deferred
                }
                // Answers completed a probe: decide those jobs with whatever else is queued.
                None if !self.batch.is_empty() => {
                    let deferred = self.gather(&rx);
                    self.process_batch();
                    deferred
                }
                None => None,
                other => other,
            };
            match deferred {
                Some(ShardMsg::Control(c)) => self.control(c),
                Some(ShardMsg::Stop) => break,
                Some(ShardMsg::Jobs(_)) | None => {}
            }
        }
        self.ctx.inflight.release_all(self.ctx.index);
    }

    /// Adds jobs queued since the batch started (group commit), up to `max_batch` or the
    /// linger deadline. Returns a non-job message that arrived meanwhile, to run after
    /// the batch.
    fn gather(&mut self, rx: &Receiver<ShardMsg>) -> Option<ShardMsg> {
        let max_batch = self.ctx.config.max_batch.get();
        let linger = self.ctx.config.max_linger;
        let deadline = Instant::now() + linger;
        while self.batch.len() < max_batch {
            let next = if linger.is_zero() {
                rx.try_recv().map_err(|e| matches!(e, TryRecvError::Empty))
            } else {
                rx.recv_deadline(deadline).map_err(|e| e.is_timeout())
            };
            match next {
                Ok(ShardMsg::Jobs(more)) => self.batch.extend(more),
                Ok(other) => return Some(other),
                Err(_) => break,
            }
        }
        None
    }

    /// Answers another shard's probe from this shard's committed claims, or takes an
    /// answer to one of ours; when every shard answered, its jobs join the next batch.
    fn peer(&mut self, msg: PeerMsg) {
        match msg {
            PeerMsg::Probe { from, group, keys } => {
                let found = self.probe_answer(&keys);
                if let Some(peer) = self.ctx.peers.get().and_then(|p| p.get(from)) {
                    let _ = peer.send(PeerMsg::Reply { group, found });
                }
            }
            PeerMsg::Reply { group, found } => {
                let Some(g) = self.probing.get_mut(&group) else {
                    return;
                };
                match found {
                    Ok(found) => {
                        for (mine, theirs) in g.found.iter_mut().zip(found) {
                            *mine = ClaimRecord::newer(*mine, theirs);
                        }
                    }
                    Err(e) => {
                        g.failed.get_or_insert(e);
                    }
                }
                g.outstanding -= 1;
                if g.outstanding == 0 {
                    if let Some(g) = self.probing.remove(&group) {
                        self.probe_done(g);
                    }
                }
            }
        }
    }

    fn probe_done(&mut self, g: ProbeGroup) {
        if let Some(e) = g.failed {
            let reason = e.to_string();
            let pairs: Vec<_> = g.jobs.iter().map(|j| (j.subscriber, j.key)).collect();
            self.ctx.inflight.release(pairs, self.ctx.index);
            send_outcomes(
                g.jobs
                    .into_iter()
                    .map(|j| {
                        (
                            j,
                            Outcome::Failed {
                                reason: reason.clone(),
                            },
                        )
                    })
                    .collect(),
            );
            return;
        }
        for (mut job, found) in g.jobs.into_iter().zip(g.found) {
            job.probed = Some(found);
            self.batch.push(job);
        }
    }

    /// The newest record of each key in this shard, tombstones included (I2).
    fn probe_answer(
        &mut self,
        keys: &[(SubscriberId, u128)],
    ) -> Result<Vec<Option<ClaimRecord>>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut txn = None;
        let mut out = Vec::with_capacity(keys.len());
        for &(sub, key) in keys {
            out.push(self.newest_record(sub, key, &mut txn)?);
        }
        Ok(out)
    }

    /// Sends this batch's probes: one message per other shard for all of its keys.
    fn send_probes(&mut self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let keys: Vec<(SubscriberId, u128)> = jobs.iter().map(|j| (j.subscriber, j.key)).collect();
        self.next_group += 1;
        let group = self.next_group;
        let mut g = ProbeGroup {
            found: vec![None; jobs.len()],
            jobs,
            outstanding: 0,
            failed: None,
        };
        let peers = self
            .ctx
            .peers
            .get()
            .map(|p| p.as_slice())
            .unwrap_or_default();
        for (i, peer) in peers.iter().enumerate() {
            if i == self.ctx.index {
                continue;
            }
            let probe = PeerMsg::Probe {
                from: self.ctx.index,
                group,
                keys: keys.clone(),
            };
            if peer.send(probe).is_ok() {
                g.outstanding += 1;
            } else {
                g.failed = Some(LedgerError::Poisoned(format!("shard {i} stopped")));
            }
        }
        if g.outstanding == 0 {
            self.probe_done(g);
        } else {
            self.probing.insert(group, g);
        }
    }

    fn poison(&mut self, e: LedgerError) {
        tracing::error!(shard = self.ctx.index, error = %e, "the shard stops acknowledging");
        let mut p = self.ctx.poison.lock().unwrap_or_else(|p| p.into_inner());
        if p.is_none() {
            *p = Some(e.to_string());
        }
        self.ctx.poisoned.store(true, Ordering::Release);
        self.failed = Some(e);
    }

    fn process_batch(&mut self) {
        let started = Instant::now();
        let mut jobs = std::mem::take(&mut self.batch);
        let now = self.ctx.clock.now_ms();
        for job in jobs.iter_mut().filter(|j| j.received_at_ms == 0) {
            job.received_at_ms = now;
        }
        if self.failed.is_none() && self.ctx.poisoned.load(Ordering::Acquire) {
            // Another shard failed: the whole ledger stops acknowledging (G7).
            let reason = self
                .ctx
                .poison
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or_default();
            self.failed = Some(LedgerError::Poisoned(reason));
        }
        let (decisions, maintenance) = match &self.failed {
            Some(e) => (Err(e.clone()), false),
            None => match self.commit_batch_catching_panics(&jobs, now) {
                Ok((d, m)) => (Ok(d), m),
                Err(e) => {
                    self.abandon_batch();
                    self.poison(e.clone());
                    (Err(e), false)
                }
            },
        };
        let elapsed = started.elapsed().as_micros() as u64;
        let count = jobs.len() as u64;
        let mut done = Vec::with_capacity(jobs.len());
        let mut probes = Vec::new();
        let mut decided_elsewhere = Vec::new();
        match decisions {
            Ok(decisions) => {
                for (mut job, d) in jobs.drain(..).zip(decisions) {
                    // The batch that used the other shards' answer committed: give the key
                    // back (a retried job asks again next time).
                    if job.probed.take().is_some() {
                        decided_elsewhere.push((job.subscriber, job.key));
                    }
                    match d {
                        Decision::Done(outcome) => done.push((job, outcome)),
                        Decision::Probe => probes.push(job),
                        Decision::Wait => {
                            self.retry_order += 1;
                            self.retries.push(Retry {
                                due: Instant::now() + WAIT_FOR_KEY,
                                order: self.retry_order,
                                job,
                            });
                        }
                        Decision::Retry(failure) => {
                            let backoff = self.subs[job.subscriber.0 as usize]
                                .as_ref()
                                .map_or(Duration::from_millis(50), |s| s.retry_backoff);
                            let delay = backoff.saturating_mul(1 << (job.attempt - 1).min(16));
                            tracing::debug!(shard = self.ctx.index, id = %job.id, attempt = job.attempt,
                                error = %failure, "handler failed; retrying after {delay:?}");
                            job.attempt += 1;
                            self.retry_order += 1;
                            self.retries.push(Retry {
                                due: Instant::now() + delay,
                                order: self.retry_order,
                                job,
                            });
                        }
                    }
                }
            }
            Err(e) => {
                let reason = e.to_string();
                self.ctx.inflight.release_all(self.ctx.index);
                // Jobs waiting for answers will never be decided either.
                let waiting: Vec<Job> = self.probing.drain().flat_map(|(_, g)| g.jobs).collect();
                done.extend(waiting.into_iter().map(|j| {
                    (
                        j,
                        Outcome::Failed {
                            reason: reason.clone(),
                        },
                    )
                }));
                done.extend(jobs.drain(..).map(|j| {
                    (
                        j,
                        Outcome::Failed {
                            reason: reason.clone(),
                        },
                    )
                }));
                // Messages waiting for a retry will never be decided either.
                done.extend(self.retries.drain().map(|r| {
                    (
                        r.job,
                        Outcome::Failed {
                            reason: reason.clone(),
                        },
                    )
                }));
            }
        }
        self.ctx.inflight.release(decided_elsewhere, self.ctx.index);
        send_outcomes(done);
        self.send_probes(probes);
        metrics::histogram!("dedupd_batch_duration_seconds", "shard" => self.ctx.index.to_string())
            .record(elapsed as f64 / 1e6);
        {
            let mut m = self.ctx.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.batches += 1;
            m.messages += count;
            if maintenance {
                m.max_batch_us_maintenance = m.max_batch_us_maintenance.max(elapsed);
            } else {
                m.max_batch_us_plain = m.max_batch_us_plain.max(elapsed);
            }
        }
        self.batch = jobs;
    }

    /// [`Shard::commit_batch`], with a panic (a native handler's bug, say) turned into an
    /// error. The unwinding dropped the batch's transaction uncommitted, so nothing of the
    /// batch is durable; the caller stops the shard as after a storage error (I4).
    fn commit_batch_catching_panics(
        &mut self,
        jobs: &[Job],
        now: u64,
    ) -> Result<(Vec<Decision>, bool), LedgerError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.commit_batch(jobs, now)
        }))
        .unwrap_or_else(|panic| {
            Err(LedgerError::Panicked {
                path: self.ctx.path.clone(),
                detail: super::panic_message(&*panic),
            })
        })
    }

    /// Moves retries whose backoff has passed into the current batch.
    fn take_due_retries(&mut self) {
        let now = Instant::now();
        while self.retries.peek().is_some_and(|r| r.due <= now) {
            if let Some(r) = self.retries.pop() {
                self.batch.push(r.job);
            }
        }
    }

    /// After a failed commit the in-memory state may hold claims that never became durable;
    /// nothing will be decided against it again (I4), so only scratch buffers are cleared.
    fn abandon_batch(&mut self) {
        self.quarantine_rows.clear();
        self.dead_rows.clear();
        self.settled.clear();
        for st in self.subs.iter_mut().flatten() {
            LogRow::start(&mut st.pending_log);
            st.view = None;
        }
    }

    #[inline]
    fn sub_index(&mut self, id: SubscriberId) -> Result<usize, LedgerError> {
        let idx = id.0 as usize;
        if matches!(self.subs.get(idx), Some(Some(_))) {
            return Ok(idx);
        }
        if self.subs.len() <= idx {
            self.subs.resize_with(idx + 1, || None);
        }
        if self.subs[idx].is_none() {
            let spec = self.ctx.registry.get(id).ok_or_else(|| {
                LedgerError::InvalidSubscriber(format!("unknown subscriber id {}", id.0))
            })?;
            let st = new_sub_state(&spec, &self.db).map_err(|e| self.err(e))?;
            self.subs[idx] = Some(st);
        }
        Ok(idx)
    }

    /// Brings each subscriber of this batch up to date with its handler in the registry:
    /// a new or replaced handler takes effect here, between batches, never inside one.
    fn sync_handlers(&mut self, jobs: &[Job]) -> Result<(), LedgerError> {
        let mut seen: Vec<SubscriberId> = Vec::new();
        for job in jobs {
            if !seen.contains(&job.subscriber) {
                seen.push(job.subscriber);
            }
        }
        for id in seen {
            let idx = self.sub_index(id)?;
            let spec = self.ctx.registry.get(id);
            let want = spec.as_ref().and_then(|s| s.handler());
            let Some(st) = self.subs[idx].as_mut() else {
                continue;
            };
            if let Some(spec) = &spec {
                if spec.settings_epoch() != st.settings_epoch {
                    apply_settings(st, spec);
                }
                st.probe = placement::needs_probe(
                    spec.placements.load(Ordering::Acquire) | st.disk_mask,
                    self.ctx.count,
                );
            }
            let current = st.handler.as_ref().map(|h| &h.factory);
            let same = match (current, &want) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            };
            if same {
                continue;
            }
            st.handler = want.map(|factory| {
                let instance = factory.instantiate().unwrap_or_else(|e| {
                    tracing::error!(shard = self.ctx.index, subscriber = %st.name, error = %e,
                        "handler cannot be instantiated; its messages fail and are dead-lettered");
                    Box::new(Unavailable(format!("handler cannot be instantiated: {e}")))
                });
                ShardHandler { factory, instance }
            });
        }
        Ok(())
    }

    /// Decides every job of a batch, runs handlers for new messages, writes claims and
    /// handler effects, runs a slice of maintenance, and commits durably. On `Err` nothing
    /// of this batch is durable and the shard must stop.
    fn commit_batch(
        &mut self,
        jobs: &[Job],
        now: u64,
    ) -> Result<(Vec<Decision>, bool), LedgerError> {
        self.sync_handlers(jobs)?;
        let mut txn = self.db.begin_write().map_err(|e| self.err(e))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| LedgerError::Storage {
                path: self.ctx.path.clone(),
                detail: e.to_string(),
            })?;
        let t0 = Instant::now();
        let mut decisions = Vec::with_capacity(jobs.len());
        let mut wrote = false;
        let presize = self.ctx.config.generation_max_claims.get();
        // Per-subscriber counters of this batch, indexed by subscriber id:
        // processed, duplicates, quarantined, probes, false positives, refreshes,
        // dead-lettered, retries.
        let mut counts: Vec<[u64; 8]> = Vec::new();
        {
            let mut open: HashMap<u64, redb::Table<u128, [u8; CLAIM_LEN]>> = HashMap::new();
            for job in jobs {
                let idx = self.sub_index(job.subscriber)?;
                if counts.len() <= idx {
                    counts.resize(idx + 1, [0; 8]);
                }
                let c = &mut counts[idx];
                let st = self.subs[idx].as_mut().ok_or_else(|| {
                    LedgerError::InvalidSubscriber("subscriber state missing".into())
                })?;
                let existing = match st.find_in_memory(job.key) {
                    Found::Active(r) | Found::Older(r) => Some(r),
                    Found::AskSealed => {
                        let mut hit = None;
                        for g in st.sealed.iter().rev() {
                            c[3] += 1;
                            if !g.filter.may_contain(job.key) {
                                continue;
                            }
                            let table = match open.entry(g.table_id) {
                                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                                std::collections::hash_map::Entry::Vacant(v) => {
                                    let name = tables::claims_name(&st.name, g.table_id);
                                    v.insert(
                                        txn.open_table(claims_def(&name))
                                            .map_err(|e| storage(&self.ctx.path, e))?,
                                    )
                                }
                            };
                            match table.get(job.key).map_err(|e| storage(&self.ctx.path, e))? {
                                Some(v) => {
                                    hit = Some(ClaimRecord::decode(&v.value()));
                                    break;
                                }
                                None => c[4] += 1,
                            }
                        }
                        hit
                    }
                };
                // No live claim here: the subscriber's claims may be on other shards too
                // (`placement.rs`). Ask them first, holding the key in flight.
                let existing = match (&job.probed, existing) {
                    (_, Some(r)) if r.is_live(now) => Some(r),
                    (Some(elsewhere), here) => ClaimRecord::newer(here, *elsewhere),
                    (None, _) if st.probe => {
                        let d =
                            match self
                                .ctx
                                .inflight
                                .acquire(job.subscriber, job.key, self.ctx.index)
                            {
                                Acquire::Taken => Decision::Probe,
                                Acquire::Busy => Decision::Wait,
                            };
                        decisions.push(d);
                        continue;
                    }
                    (None, here) => here,
                };
                let decision = match existing {
                    Some(r) if r.is_live(now) && r.fingerprint == job.fingerprint => {
                        if st.sliding {
                            let refreshed = ClaimRecord {
                                expires_at_ms: now.saturating_add(st.ttl_ms),
                                ..r
                            };
                            insert_claim(
                                st,
                                &mut self.next_table_id,
                                job.key,
                                refreshed,
                                now,
                                presize,
                                &mut self.spare_maps,
                            );
                            c[5] += 1;
                            st.mask_pending |=
                                placement_bit(job, self.ctx.index, self.ctx.count, &st.name);
                            wrote = true;
                        }
                        c[1] += 1;
                        Decision::Done(Outcome::Duplicate)
                    }
                    Some(r) if r.is_live(now) && !job.replace => {
                        self.quarantine_rows
                            .push(records::quarantine(st, job, r.fingerprint, now));
                        st.quarantined += 1;
                        c[2] += 1;
                        wrote = true;
                        Decision::Done(Outcome::Quarantined {
                            stored_fingerprint: r.fingerprint,
                        })
                    }
                    _ => {
                        // New. With a handler, the claim commits only with its effects.
                        let handled = match st.handler.as_mut() {
                            None => Ok(0),
                            Some(h) => {
                                let view = match st.view.take() {
                                    Some(v) => v,
                                    None => {
                                        st.state_buf.tend_marks(&self.db, &st.name);
                                        Box::new(
                                            BatchView::open(&self.db, &st.name, &st.state_buf)
                                                .map_err(|e| storage(&self.ctx.path, e))?,
                                        )
                                    }
                                };
                                // Reuses the previous message's buffers.
                                let msg = &mut self.handler_msg;
                                msg.subscriber.clear();
                                msg.subscriber.push_str(&st.name);
                                msg.id.clear();
                                msg.id.push_str(&job.id);
                                msg.key.clone_from(&job.partition_key);
                                msg.headers.clone_from(&job.headers);
                                msg.payload.clear();
                                msg.payload.extend_from_slice(&job.payload);
                                msg.attempt = job.attempt;
                                msg.received_at_ms = job.received_at_ms;
                                let mut view = view;
                                view.set_scope(job.entity.as_deref());
                                let (mut view, result) = h.instance.handle(msg, view);
                                let version = h.factory.version();
                                let handled = result.map(|effects| {
                                    view.absorb(effects);
                                    version
                                });
                                st.view = Some(view);
                                handled
                            }
                        };
                        if let Err(f) = &handled {
                            let kind = f.kind();
                            if let (Some(i), Some(spec)) = (
                                super::HANDLER_FAILURE_KINDS.iter().position(|k| *k == kind),
                                self.ctx.registry.get(job.subscriber),
                            ) {
                                spec.counters.handler_failures[i].fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        match handled {
                            Ok(handler_version) => {
                                let claim = ClaimRecord {
                                    fingerprint: job.fingerprint,
                                    processed_at_ms: now,
                                    expires_at_ms: now.saturating_add(st.ttl_ms),
                                    handler_version,
                                };
                                insert_claim(
                                    st,
                                    &mut self.next_table_id,
                                    job.key,
                                    claim,
                                    now,
                                    presize,
                                    &mut self.spare_maps,
                                );
                                c[0] += 1;
                                st.mask_pending |=
                                    placement_bit(job, self.ctx.index, self.ctx.count, &st.name);
                                wrote = true;
                                Decision::Done(Outcome::Processed)
                            }
                            Err(f) if f.is_retryable() && job.attempt < st.max_attempts => {
                                c[7] += 1;
                                Decision::Retry(f)
                            }
                            Err(f) => {
                                let reason =
                                    format!("{f} (attempt {} of {})", job.attempt, st.max_attempts);
                                self.dead_rows
                                    .push(records::dead_letter(st, job, &f, &reason, now));
                                st.dead_lettered += 1;
                                c[6] += 1;
                                wrote = true;
                                Decision::Done(Outcome::DeadLettered {
                                    reason,
                                    attempts: job.attempt,
                                })
                            }
                        }
                    }
                };
                if let (Some((kind, seq)), Decision::Done(outcome)) = (job.settle, &decision) {
                    if !matches!(outcome, Outcome::Quarantined { .. }) {
                        self.settled.push((kind, job.subscriber, seq));
                        wrote = true;
                    }
                }
                decisions.push(decision);
            }
        }
        let t1 = Instant::now();
        if wrote {
            self.write_placements(&txn)?;
            self.write_logs(&txn)?;
            // Before new records: a replay dead-lettered again is a new record, not a
            // repeat merged into the one it settles.
            self.remove_settled(&txn)?;
            self.write_quarantine(&txn)?;
            self.write_handler_effects(&txn, now)?;
        }
        // A view holds a snapshot of this batch; the next batch reads a fresh one.
        for st in self.subs.iter_mut().flatten() {
            st.view = None;
        }
        let t2 = Instant::now();
        let budget = slice_budget(jobs.len());
        let maintenance = self.maintenance(&txn, now, budget, false)?;
        let t3 = Instant::now();
        self.request_spare_map();
        if wrote || maintenance {
            self.write_counters(&txn)?;
            let started = Instant::now();
            txn.commit().map_err(|e| self.err(e))?;
            metrics::histogram!("dedupd_commit_duration_seconds", "shard" => self.ctx.index.to_string())
                .record(started.elapsed().as_secs_f64());
            let mut m = self.ctx.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.commits += 1;
            m.max_commit_us = m.max_commit_us.max(started.elapsed().as_micros() as u64);
            let total = t0.elapsed();
            if total > Duration::from_millis(40) {
                tracing::debug!(
                    shard = self.ctx.index,
                    jobs = jobs.len(),
                    decide_ms = (t1 - t0).as_millis() as u64,
                    log_ms = (t2 - t1).as_millis() as u64,
                    maintenance_ms = (t3 - t2).as_millis() as u64,
                    commit_ms = started.elapsed().as_millis() as u64,
                    "slow batch"
                );
            }
        } else {
            txn.abort().map_err(|e| self.err(e))?;
        }
        for (id, c) in counts.into_iter().enumerate() {
            if c == [0; 8] {
                continue;
            }
            if let Some(spec) = self.ctx.registry.get(SubscriberId(id as u32)) {
                let k = &spec.counters;
                k.processed.fetch_add(c[0], Ordering::Relaxed);
                k.duplicates.fetch_add(c[1], Ordering::Relaxed);
                k.quarantined.fetch_add(c[2], Ordering::Relaxed);
                k.filter_probes.fetch_add(c[3], Ordering::Relaxed);
                k.filter_false_positives.fetch_add(c[4], Ordering::Relaxed);
                k.sliding_refreshes.fetch_add(c[5], Ordering::Relaxed);
                k.dead_lettered.fetch_add(c[6], Ordering::Relaxed);
                k.retries.fetch_add(c[7], Ordering::Relaxed);
            }
        }
        Ok((decisions, maintenance))
    }

    /// Writes the effects of this batch's successful handler calls and its dead letters.
    fn write_handler_effects(
        &mut self,
        txn: &WriteTransaction,
        now: u64,
    ) -> Result<(), LedgerError> {
        let path = self.ctx.path.clone();
        for st in self.subs.iter_mut().flatten() {
            let Some(view) = st.view.take() else {
                continue;
            };
            let mut effects = view.into_effects();
            let outbox = std::mem::take(&mut effects.outbox);
            handlers::write_outbox(txn, &st.name, &outbox, &mut self.next_outbox_seq, now)
                .map_err(|e| storage(&path, e))?;
            if !effects.is_empty() {
                st.state_buf
                    .append(txn, &st.name, effects)
                    .map_err(|e| storage(&path, e))?;
            }
        }
        self.write_records(txn, RecordKind::DeadLetter).map(|_| ())
    }

    /// Appends this batch's claims as one row per subscriber to its active log, and records
    /// new active generations.
    /// Records placements of this batch's claims that this shard had not recorded yet, so
    /// a restart knows to probe (`placement.rs`).
    fn write_placements(&mut self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        let mut table = None;
        for st in self.subs.iter_mut().flatten() {
            let new = st.mask_pending & !st.disk_mask;
            st.mask_pending = 0;
            if new == 0 {
                continue;
            }
            if table.is_none() {
                table = Some(
                    txn.open_table(tables::PLACEMENTS)
                        .map_err(|e| storage(&self.ctx.path, e))?,
                );
            }
            if let Some(t) = table.as_mut() {
                t.insert(&*st.name, st.disk_mask | new)
                    .map_err(|e| storage(&self.ctx.path, e))?;
            }
            st.disk_mask |= new;
        }
        Ok(())
    }

    fn write_logs(&mut self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        let path = self.ctx.path.clone();
        let err = |e: redb::TableError| storage(&path, e);
        let serr = |e: redb::StorageError| storage(&path, e);
        for st in self.subs.iter_mut().flatten() {
            if LogRow::is_empty(&st.pending_log) {
                continue;
            }
            let Some(active) = st.active.as_mut() else {
                continue;
            };
            if active.next_row == 0 {
                let meta = GenMeta {
                    state: GenState::Active,
                    order: active.order,
                    count: 0,
                    max_expires_ms: 0,
                    created_at_ms: active.created_at_ms,
                };
                let mut gens = txn.open_table(tables::GENERATIONS).map_err(err)?;
                gens.insert((&*st.name, active.table_id), meta.encode().as_slice())
                    .map_err(serr)?;
            }
            let name = tables::log_name(&st.name, active.table_id);
            let mut t = txn.open_table(log_def(&name)).map_err(err)?;
            t.insert(active.next_row, st.pending_log.as_slice())
                .map_err(serr)?;
            active.next_row += 1;
            LogRow::start(&mut st.pending_log);
        }
        Ok(())
    }

    /// Removes the records that replayed jobs settled in this batch.
    fn remove_settled(&mut self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        for (kind, sub, seq) in std::mem::take(&mut self.settled) {
            let idx = self.sub_index(sub)?;
            if let Some(st) = self.subs[idx].as_mut() {
                remove_record(txn, &self.ctx.path, st, kind, seq)?;
            }
        }
        Ok(())
    }

    fn write_quarantine(&mut self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        self.write_records(txn, RecordKind::Quarantine).map(|_| ())
    }

    /// Stores this batch's quarantine or dead-letter rows, merging repeats (see records.rs).
    fn write_records(
        &mut self,
        txn: &WriteTransaction,
        kind: RecordKind,
    ) -> Result<Vec<u64>, LedgerError> {
        let (rows, next_seq) = match kind {
            RecordKind::Quarantine => (&mut self.quarantine_rows, &mut self.next_quarantine_seq),
            RecordKind::DeadLetter => (&mut self.dead_rows, &mut self.next_dead_seq),
        };
        records::store(
            txn,
            kind,
            rows,
            next_seq,
            &mut self.subs,
            records::Limits::of(&self.ctx.config, self.ctx.count),
            &self.ctx.registry,
        )
        .map_err(|e| storage(&self.ctx.path, e))
    }

    fn write_counters(&self, txn: &WriteTransaction) -> Result<(), LedgerError> {
        let mut meta = txn.open_table(tables::META).map_err(|e| self.err(e))?;
        meta.insert("next_table_id", self.next_table_id)
            .map_err(|e| self.err(e))?;
        meta.insert("next_quarantine_seq", self.next_quarantine_seq)
            .map_err(|e| self.err(e))?;
        meta.insert("next_outbox_seq", self.next_outbox_seq)
            .map_err(|e| self.err(e))?;
        meta.insert("next_dead_seq", self.next_dead_seq)
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Work between batches when the queue is empty: finish sealing and merging sooner.
    fn idle(&mut self) {
        if self.failed.is_some() || !self.has_pending_work(false) {
            return;
        }
        let now = self.ctx.clock.now_ms();
        if let Err(e) = self.maintenance_txn(now, IDLE_SLICE, false) {
            self.poison(e);
        }
    }

    fn has_pending_work(&self, seal_all: bool) -> bool {
        let now = self.ctx.clock.now_ms();
        let cfg = &self.ctx.config;
        let expiry_due = now.saturating_sub(self.last_expiry_check_ms) >= EXPIRY_CHECK_MS;
        !self.retired_logs.is_empty()
            || records::sweep_due(&self.subs, now)
            || self.subs.iter().flatten().any(|st| {
                st.state_buf.has_work(cfg.state_buffer_entries.get())
                    || st.sealing.is_some()
                    || st.merging.is_some()
                    || st.sealed.len() > cfg.merge_trigger_generations.get()
                    || (expiry_due && st.sealed.iter().any(|g| g.max_expires_ms <= now))
                    || st.active.as_ref().is_some_and(|a| {
                        !a.map.is_empty()
                            && (seal_all
                                || a.map.len() >= cfg.generation_max_claims.get()
                                || now.saturating_sub(a.created_at_ms)
                                    >= cfg.generation_max_age.as_millis() as u64)
                    })
            })
    }

    /// One durable transaction of maintenance only.
    fn maintenance_txn(
        &mut self,
        now: u64,
        budget: usize,
        seal_all: bool,
    ) -> Result<bool, LedgerError> {
        let started = Instant::now();
        let mut txn = self.db.begin_write().map_err(|e| self.err(e))?;
        txn.set_durability(Durability::Immediate)
            .map_err(|e| LedgerError::Storage {
                path: self.ctx.path.clone(),
                detail: e.to_string(),
            })?;
        let did = self.maintenance(&txn, now, budget, seal_all)?;
        if did {
            self.write_counters(&txn)?;
            txn.commit().map_err(|e| self.err(e))?;
            metrics::histogram!("dedupd_commit_duration_seconds", "shard" => self.ctx.index.to_string())
                .record(started.elapsed().as_secs_f64());
            let mut m = self.ctx.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.commits += 1;
            m.max_batch_us_maintenance = m
                .max_batch_us_maintenance
                .max(started.elapsed().as_micros() as u64);
        } else {
            txn.abort().map_err(|e| self.err(e))?;
        }
        Ok(did)
    }

    /// Sealing, merging and expiry, bounded by `budget` rows written. Returns whether it
    /// wrote anything (the caller then commits).
    fn maintenance(
        &mut self,
        txn: &WriteTransaction,
        now: u64,
        budget: usize,
        seal_all: bool,
    ) -> Result<bool, LedgerError> {
        let mut did = false;
        while let Ok(built) = self.built_rx.try_recv() {
            self.attach_built(built);
        }
        let expiry_due = now.saturating_sub(self.last_expiry_check_ms) >= EXPIRY_CHECK_MS;
        if expiry_due {
            self.last_expiry_check_ms = now;
        }
        let cfg = self.ctx.config.clone();
        for idx in 0..self.subs.len() {
            let Some(mut st) = self.subs[idx].take() else {
                continue;
            };
            let r = self.maintain_sub(&mut st, txn, now, budget, seal_all, expiry_due, &cfg);
            self.subs[idx] = Some(st);
            did |= r?;
        }
        did |= records::sweep(
            txn,
            &mut self.subs,
            now,
            records::Limits::of(&cfg, self.ctx.count),
            &self.ctx.registry,
        )
        .map_err(|e| self.err(e))?;
        did |= self.trim_retired_log(
            txn,
            if budget >= IDLE_SLICE {
                64
            } else {
                RETIRE_ROWS
            },
        )?;
        Ok(did)
    }

    #[allow(clippy::too_many_arguments)]
    fn maintain_sub(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        now: u64,
        budget: usize,
        seal_all: bool,
        expiry_due: bool,
        cfg: &LedgerConfig,
    ) -> Result<bool, LedgerError> {
        let mut did = st
            .state_buf
            .maintain(
                txn,
                &st.name,
                cfg.state_buffer_entries.get(),
                budget,
                seal_all,
            )
            .map_err(|e| self.err(e))?;
        // Start sealing a full or old active generation.
        let due = st.active.as_ref().is_some_and(|a| {
            a.next_row > 0
                && !a.map.is_empty()
                && (seal_all
                    || a.map.len() >= cfg.generation_max_claims.get()
                    || now.saturating_sub(a.created_at_ms)
                        >= cfg.generation_max_age.as_millis() as u64)
        });
        if due && st.sealing.is_none() {
            if let Some(a) = st.active.take() {
                let mut gens = txn
                    .open_table(tables::GENERATIONS)
                    .map_err(|e| self.err(e))?;
                let meta = GenMeta {
                    state: GenState::Sealing,
                    order: a.order,
                    count: a.map.len() as u64,
                    max_expires_ms: 0,
                    created_at_ms: a.created_at_ms,
                };
                gens.insert((&*st.name, a.table_id), meta.encode().as_slice())
                    .map_err(|e| self.err(e))?;
                drop(gens);
                let gen = SealingGen {
                    table_id: a.table_id,
                    order: a.order,
                    created_at_ms: a.created_at_ms,
                    map: Arc::new(a.map),
                    built: None,
                    pos: 0,
                    extra_logs: Vec::new(),
                };
                self.start_sealing(st, gen, now);
                did = true;
            }
        }
        // Write a slice of the sealing generation; finish it when complete.
        if let Some(s) = st.sealing.as_mut() {
            if let Some((entries, filter)) = s.built.as_ref() {
                let name = tables::claims_name(&st.name, s.table_id);
                let end = (s.pos + budget).min(entries.len());
                let ts = Instant::now();
                {
                    let mut t = txn.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
                    for (k, r) in &entries[s.pos..end] {
                        t.insert(*k, r.encode()).map_err(|e| self.err(e))?;
                    }
                }
                tracing::trace!(
                    rows = end - s.pos,
                    us = ts.elapsed().as_micros() as u64,
                    done = end == entries.len(),
                    "seal slice"
                );
                s.pos = end;
                did = true;
                if s.pos == entries.len() {
                    let max_expires = entries.iter().map(|e| e.1.expires_at_ms).max().unwrap_or(0);
                    let count = entries.len() as u64;
                    let filter = filter.clone();
                    let (table_id, order, created, extra) = (
                        s.table_id,
                        s.order,
                        s.created_at_ms,
                        std::mem::take(&mut s.extra_logs),
                    );
                    self.commit_sealed(
                        txn,
                        st,
                        SealedGen {
                            table_id,
                            order,
                            count,
                            max_expires_ms: max_expires,
                            created_at_ms: created,
                            filter,
                        },
                    )?;
                    let mut gens = txn
                        .open_table(tables::GENERATIONS)
                        .map_err(|e| self.err(e))?;
                    for id in &extra {
                        gens.remove((&*st.name, *id)).map_err(|e| self.err(e))?;
                    }
                    drop(gens);
                    // The log is dead now (its generation row says Sealed); it is removed a
                    // few rows per batch, since dropping it whole reads every page (~30 ms).
                    for id in std::iter::once(table_id).chain(extra) {
                        self.retired_logs.push_back(tables::log_name(&st.name, id));
                    }
                    if let Some(done) = st.sealing.take() {
                        if let Ok(mut map) = Arc::try_unwrap(done.map) {
                            if self.spare_maps.len() < 2 {
                                map.clear();
                                self.spare_maps.push(map);
                            }
                        }
                    }
                    self.ctx
                        .metrics
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .seals += 1;
                }
            }
        }
        // Drop sealed generations whose every claim has expired.
        if expiry_due {
            let busy = st.merging.as_ref().map(|m| (m.older, m.newer));
            let mut i = 0;
            while i < st.sealed.len() {
                let g = &st.sealed[i];
                let in_merge = busy.is_some_and(|(a, b)| g.table_id == a || g.table_id == b);
                if g.max_expires_ms <= now && !in_merge {
                    let id = g.table_id;
                    self.delete_generation(txn, &st.name, id)?;
                    st.sealed.remove(i);
                    self.ctx
                        .metrics
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .dropped_generations += 1;
                    did = true;
                } else {
                    i += 1;
                }
            }
        }
        // Merge small neighbours so lookups probe few generations.
        if st.merging.is_none() && st.sealed.len() > cfg.merge_trigger_generations.get() {
            let limit = cfg.merge_max_claims.get() as u64;
            let pick = (0..st.sealed.len().saturating_sub(1))
                .map(|i| (st.sealed[i].count + st.sealed[i + 1].count, i))
                .filter(|(n, _)| *n <= limit)
                .min();
            if let Some((_, i)) = pick {
                let out_table = self.next_table_id;
                self.next_table_id += 1;
                st.merging = Some(MergeJob {
                    older: st.sealed[i].table_id,
                    newer: st.sealed[i + 1].table_id,
                    out_table,
                    cursor_older: None,
                    cursor_newer: None,
                    older_done: false,
                    newer_done: false,
                    keys: Vec::new(),
                    count: 0,
                    max_expires_ms: 0,
                    waiting_for_filter: false,
                    filter: None,
                });
                did = true;
            }
        }
        if st.merging.is_some() {
            did |= self.merge_step(st, txn, now, budget)?;
        }
        Ok(did)
    }

    /// Removes up to `rows` rows of the oldest retired log; drops the table once empty.
    fn trim_retired_log(
        &mut self,
        txn: &WriteTransaction,
        rows: usize,
    ) -> Result<bool, LedgerError> {
        let Some(name) = self.retired_logs.front().cloned() else {
            return Ok(false);
        };
        let empty = {
            let mut t = txn.open_table(log_def(&name)).map_err(|e| self.err(e))?;
            for _ in 0..rows {
                if t.pop_first().map_err(|e| self.err(e))?.is_none() {
                    break;
                }
            }
            t.is_empty().map_err(|e| self.err(e))?
        };
        if empty {
            txn.delete_table(log_def(&name)).map_err(|e| self.err(e))?;
            self.retired_logs.pop_front();
        }
        Ok(true)
    }

    /// Keeps one resident index ready for the next active generation.
    fn request_spare_map(&mut self) {
        if self.spare_maps.is_empty() && !self.map_requested {
            self.map_requested = self.ctx.builder.send(BuildJob::PrepareMap {
                capacity: self.ctx.config.generation_max_claims.get(),
                reply: self.built_tx.clone(),
            });
        }
    }

    /// Hands a full generation to the builder for sorting and filter construction; its
    /// index keeps answering lookups until the sealed table commits.
    fn start_sealing(&self, st: &mut SubState, gen: SealingGen, now: u64) {
        let (table_id, map) = (gen.table_id, gen.map.clone());
        st.sealing = Some(gen);
        let sent = self.ctx.builder.send(BuildJob::Seal {
            sub: st.id,
            table_id,
            map,
            now_ms: now,
            reply: self.built_tx.clone(),
        });
        if !sent {
            tracing::error!(
                shard = self.ctx.index,
                "generation builder is gone; sealing stalls"
            );
        }
    }

    fn attach_built(&mut self, built: Built) {
        match built {
            Built::Sealed {
                sub,
                table_id,
                entries,
                filter,
            } => {
                if let Some(Some(st)) = self.subs.get_mut(sub.0 as usize) {
                    if let Some(s) = st.sealing.as_mut().filter(|s| s.table_id == table_id) {
                        s.built = Some((entries, filter));
                    }
                }
            }
            Built::Map(map) => {
                self.map_requested = false;
                self.spare_maps.push(map);
            }
            Built::Merged {
                sub,
                table_id,
                filter,
            } => {
                if let Some(Some(st)) = self.subs.get_mut(sub.0 as usize) {
                    if let Some(m) = st.merging.as_mut().filter(|m| m.out_table == table_id) {
                        m.keys.clear();
                        m.keys.shrink_to_fit();
                        m.filter = Some(filter);
                    }
                }
            }
        }
    }

    /// Records a complete sorted table as a sealed generation: its filter and `Sealed`
    /// row in this transaction (I3), and its place in the recency order in memory.
    fn commit_sealed(
        &self,
        txn: &WriteTransaction,
        st: &mut SubState,
        gen: SealedGen,
    ) -> Result<(), LedgerError> {
        let meta = GenMeta {
            state: GenState::Sealed,
            order: gen.order,
            count: gen.count,
            max_expires_ms: gen.max_expires_ms,
            created_at_ms: gen.created_at_ms,
        };
        let mut filters = txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        filters
            .insert((&*st.name, gen.table_id), gen.filter.encode().as_slice())
            .map_err(|e| self.err(e))?;
        let mut gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        gens.insert((&*st.name, gen.table_id), meta.encode().as_slice())
            .map_err(|e| self.err(e))?;
        let pos = st.sealed.partition_point(|g| g.order < gen.order);
        st.sealed.insert(pos, gen);
        Ok(())
    }

    fn delete_generation(
        &self,
        txn: &WriteTransaction,
        sub: &str,
        id: u64,
    ) -> Result<(), LedgerError> {
        txn.delete_table(claims_def(&tables::claims_name(sub, id)))
            .map_err(|e| self.err(e))?;
        let mut filters = txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        filters.remove((sub, id)).map_err(|e| self.err(e))?;
        let mut gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        gens.remove((sub, id)).map_err(|e| self.err(e))?;
        Ok(())
    }

    /// One slice of a merge, or its completion once the filter is built.
    fn merge_step(
        &mut self,
        st: &mut SubState,
        txn: &WriteTransaction,
        now: u64,
        budget: usize,
    ) -> Result<bool, LedgerError> {
        let Some(m) = st.merging.as_mut() else {
            return Ok(false);
        };
        if m.waiting_for_filter {
            let Some(filter) = m.filter.take() else {
                return Ok(false);
            };
            let (older, newer, out) = (m.older, m.newer, m.out_table);
            let oi = st.sealed.iter().position(|g| g.table_id == older);
            let ni = st.sealed.iter().position(|g| g.table_id == newer);
            let (Some(oi), Some(ni)) = (oi, ni) else {
                st.merging = None;
                return Ok(false);
            };
            let order = st.sealed[ni].order;
            let created = st.sealed[oi].created_at_ms;
            let count = m.count;
            let max_expires = m.max_expires_ms;
            self.delete_generation(txn, &st.name, older)?;
            self.delete_generation(txn, &st.name, newer)?;
            st.sealed
                .retain(|g| g.table_id != older && g.table_id != newer);
            self.commit_sealed(
                txn,
                st,
                SealedGen {
                    table_id: out,
                    order,
                    count,
                    max_expires_ms: max_expires,
                    created_at_ms: created,
                    filter,
                },
            )?;
            st.merging = None;
            self.ctx
                .metrics
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .merges += 1;
            return Ok(true);
        }
        let half = (budget / 2).max(1);
        let read = |name: &str,
                    cursor: Option<u128>,
                    done: bool|
         -> Result<(Vec<(u128, ClaimRecord)>, bool), LedgerError> {
            if done {
                return Ok((Vec::new(), true));
            }
            let t = txn.open_table(claims_def(name)).map_err(|e| self.err(e))?;
            let mut out = Vec::with_capacity(half);
            let iter = match cursor {
                None => t.range::<u128>(..),
                Some(u128::MAX) => return Ok((Vec::new(), true)),
                Some(c) => t.range::<u128>(c + 1..),
            }
            .map_err(|e| self.err(e))?;
            for row in iter.take(half) {
                let (k, v) = row.map_err(|e| self.err(e))?;
                out.push((k.value(), ClaimRecord::decode(&v.value())));
            }
            let exhausted = out.len() < half;
            Ok((out, exhausted))
        };
        let (a, a_ex) = read(
            &tables::claims_name(&st.name, m.older),
            m.cursor_older,
            m.older_done,
        )?;
        let (b, b_ex) = read(
            &tables::claims_name(&st.name, m.newer),
            m.cursor_newer,
            m.newer_done,
        )?;
        let (out, i, j) = merge_slice(&a, a_ex, &b, b_ex, now);
        if i > 0 {
            m.cursor_older = Some(a[i - 1].0);
        }
        if j > 0 {
            m.cursor_newer = Some(b[j - 1].0);
        }
        m.older_done = a_ex && i == a.len();
        m.newer_done = b_ex && j == b.len();
        {
            let name = tables::claims_name(&st.name, m.out_table);
            let mut t = txn.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
            for (k, r) in &out {
                t.insert(*k, r.encode()).map_err(|e| self.err(e))?;
                m.max_expires_ms = m.max_expires_ms.max(r.expires_at_ms);
                m.keys.push(*k);
            }
        }
        m.count += out.len() as u64;
        if m.older_done && m.newer_done {
            m.waiting_for_filter = true;
            let sent = self.ctx.builder.send(BuildJob::Filter {
                sub: st.id,
                table_id: m.out_table,
                keys: std::mem::take(&mut m.keys),
                reply: self.built_tx.clone(),
            });
            if !sent {
                tracing::error!(
                    shard = self.ctx.index,
                    "generation builder is gone; merging stalls"
                );
            }
        }
        Ok(true)
    }

    fn control(&mut self, c: Control) {
        match c {
            Control::Sync { reply } => {
                let _ = reply.send(());
            }
            Control::Lookup { sub, key, reply } => {
                let r = match &self.failed {
                    Some(e) => Err(e.clone()),
                    None => self.newest_record(sub, key, &mut None),
                };
                let _ = reply.send(r);
            }
            Control::Maintain { seal_all, reply } => {
                let _ = reply.send(self.maintain_fully(seal_all));
            }
            Control::Report { reply } => {
                let _ = reply.send(Ok(self.report()));
            }
            Control::StateLen { subscriber, reply } => {
                let r = self.flush_state(&subscriber).and_then(|()| {
                    handlers::state_len(&self.db, &subscriber).map_err(|e| self.err(e))
                });
                let _ = reply.send(r);
            }
            Control::StateEntries { subscriber, reply } => {
                let r = self.flush_state(&subscriber).and_then(|()| {
                    handlers::state_entries(&self.db, &subscriber).map_err(|e| self.err(e))
                });
                let _ = reply.send(r);
            }
            Control::Forget { sub, key, reply } => {
                let _ = reply.send(self.forget(sub, key));
            }
            Control::Records {
                kind,
                subscriber,
                from,
                limit,
                reply,
            } => {
                let _ = reply.send(self.read_records(kind, &subscriber, from, limit));
            }
            Control::DeleteRecord {
                kind,
                sub,
                seq,
                reply,
            } => {
                let _ = reply.send(self.delete_record(kind, sub, seq));
            }
            Control::AddDeadLetter { sub, row, reply } => {
                let _ = reply.send(self.add_dead_letter(sub, row));
            }
            Control::OutboxPending { limit, reply } => {
                let _ = reply.send(self.outbox_pending(limit));
            }
            Control::OutboxAck { seqs, reply } => {
                let _ = reply.send(self.outbox_ack(seqs));
            }
            Control::Backup { dest, reply } => {
                let _ = reply.send(self.backup(&dest));
            }
        }
    }

    /// One durable transaction outside a batch (between batches, on the writer thread).
    /// A failure stops the shard like a failed batch (I4).
    fn small_commit<T>(
        &mut self,
        work: impl FnOnce(&mut Self, &WriteTransaction) -> Result<T, LedgerError>,
    ) -> Result<T, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = (|| -> Result<T, LedgerError> {
            let mut txn = self.db.begin_write().map_err(|e| self.err(e))?;
            txn.set_durability(Durability::Immediate)
                .map_err(|e| LedgerError::Storage {
                    path: self.ctx.path.clone(),
                    detail: e.to_string(),
                })?;
            let out = work(self, &txn)?;
            self.write_counters(&txn)?;
            txn.commit().map_err(|e| self.err(e))?;
            Ok(out)
        })();
        if let Err(e) = &result {
            self.abandon_batch();
            self.poison(e.clone());
        }
        result
    }

    /// Applies a subscriber's buffered handler effects to its sorted state tables, so they
    /// can be read whole (state dump, counts).
    fn flush_state(&mut self, subscriber: &str) -> Result<(), LedgerError> {
        let spec = self.ctx.registry.resolve(subscriber, true)?;
        let idx = self.sub_index(spec.id)?;
        let threshold = self.ctx.config.state_buffer_entries.get();
        if self.subs[idx]
            .as_ref()
            .is_none_or(|st| st.state_buf.is_empty())
        {
            return Ok(());
        }
        self.small_commit(|shard, txn| {
            let Some(st) = shard.subs[idx].as_mut() else {
                return Ok(());
            };
            st.state_buf
                .maintain(txn, &st.name, threshold, usize::MAX, true)
                .map(|_| ())
                .map_err(|e| storage(&shard.ctx.path, e))
        })
    }

    /// Writes a tombstone over a live claim so the next delivery is processed again.
    fn forget(&mut self, sub: SubscriberId, key: u128) -> Result<bool, LedgerError> {
        let now = self.ctx.clock.now_ms();
        let Some(claim) = self.lookup(sub, key)?.filter(|r| r.is_live(now)) else {
            return Ok(false);
        };
        let idx = self.sub_index(sub)?;
        let presize = self.ctx.config.generation_max_claims.get();
        if let Some(st) = self.subs[idx].as_mut() {
            insert_claim(
                st,
                &mut self.next_table_id,
                key,
                ClaimRecord::tombstone_of(&claim, now),
                now,
                presize,
                &mut self.spare_maps,
            );
        }
        self.small_commit(|shard, txn| shard.write_logs(txn))?;
        Ok(true)
    }

    fn read_records(
        &self,
        kind: RecordKind,
        subscriber: &str,
        from: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = match txn.open_table(records::record_table(kind)) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(self.err(e)),
        };
        let mut out = Vec::new();
        for row in t
            .range((subscriber, from)..=(subscriber, u64::MAX))
            .map_err(|e| self.err(e))?
            .take(limit)
        {
            let (k, v) = row.map_err(|e| self.err(e))?;
            out.push((k.value().1, v.value().to_vec()));
        }
        Ok(out)
    }

    fn delete_record(
        &mut self,
        kind: RecordKind,
        sub: SubscriberId,
        seq: u64,
    ) -> Result<bool, LedgerError> {
        let idx = self.sub_index(sub)?;
        self.small_commit(|shard, txn| match shard.subs[idx].as_mut() {
            Some(st) => remove_record(txn, &shard.ctx.path, st, kind, seq),
            None => Ok(false),
        })
    }

    fn add_dead_letter(
        &mut self,
        sub: SubscriberId,
        row: PendingRecord,
    ) -> Result<u64, LedgerError> {
        let idx = self.sub_index(sub)?;
        let seq = self.small_commit(|shard, txn| {
            let Some(st) = shard.subs[idx].as_mut() else {
                return Err(LedgerError::InvalidSubscriber(
                    "subscriber state missing".into(),
                ));
            };
            st.dead_lettered += 1;
            shard.dead_rows.push(row);
            let seqs = shard.write_records(txn, RecordKind::DeadLetter)?;
            seqs.first()
                .copied()
                .ok_or_else(|| LedgerError::InvalidSubscriber("subscriber state missing".into()))
        })?;
        if let Some(spec) = self.ctx.registry.get(sub) {
            spec.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
        }
        Ok(seq)
    }

    fn outbox_pending(&self, limit: usize) -> Result<Vec<(u64, Vec<u8>)>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let txn = self.db.begin_read().map_err(|e| self.err(e))?;
        let t = match txn.open_table(handlers::OUTBOX) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(self.err(e)),
        };
        let mut out = Vec::new();
        for row in t.iter().map_err(|e| self.err(e))?.take(limit) {
            let (k, v) = row.map_err(|e| self.err(e))?;
            out.push((k.value(), v.value().to_vec()));
        }
        Ok(out)
    }

    fn outbox_ack(&mut self, seqs: Vec<u64>) -> Result<(), LedgerError> {
        self.small_commit(|shard, txn| {
            let mut t = txn
                .open_table(handlers::OUTBOX)
                .map_err(|e| storage(&shard.ctx.path, e))?;
            for seq in seqs {
                t.remove(seq).map_err(|e| storage(&shard.ctx.path, e))?;
            }
            Ok(())
        })
    }

    /// Copies the shard file between two commits: every commit is durable and no other
    /// thread writes the file, so the copy is the state after the last commit.
    fn backup(&self, dest: &std::path::Path) -> Result<u64, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let name = self
            .ctx
            .path
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        std::fs::copy(&self.ctx.path, dest.join(name)).map_err(|e| LedgerError::DataDir {
            path: dest.to_path_buf(),
            detail: format!("backup of {} failed: {e}", self.ctx.path.display()),
        })
    }

    fn lookup(&mut self, sub: SubscriberId, key: u128) -> Result<Option<ClaimRecord>, LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        Ok(self
            .newest_record(sub, key, &mut None)?
            .filter(|r| !r.is_tombstone()))
    }

    /// The newest record of a key in this shard, live, expired or tombstone (I2). `txn`
    /// is opened on the first sealed-generation read and reused by the caller's next call.
    fn newest_record(
        &mut self,
        sub: SubscriberId,
        key: u128,
        txn: &mut Option<redb::ReadTransaction>,
    ) -> Result<Option<ClaimRecord>, LedgerError> {
        let idx = self.sub_index(sub)?;
        let Some(st) = self.subs[idx].as_ref() else {
            return Ok(None);
        };
        match st.find_in_memory(key) {
            Found::Active(r) | Found::Older(r) => Ok(Some(r)),
            Found::AskSealed => {
                for g in st.sealed.iter().rev() {
                    if !g.filter.may_contain(key) {
                        continue;
                    }
                    if txn.is_none() {
                        *txn = Some(self.db.begin_read().map_err(|e| self.err(e))?);
                    }
                    let Some(t) = txn.as_ref() else { continue };
                    let name = tables::claims_name(&st.name, g.table_id);
                    let t = t.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
                    if let Some(v) = t.get(key).map_err(|e| self.err(e))? {
                        return Ok(Some(ClaimRecord::decode(&v.value())));
                    }
                }
                Ok(None)
            }
        }
    }

    /// Runs maintenance transactions until no sealing, merging or expiry work is left.
    fn maintain_fully(&mut self, seal_all: bool) -> Result<(), LedgerError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut first = seal_all;
        loop {
            let now = self.ctx.clock.now_ms();
            self.last_expiry_check_ms = 0;
            let did = match self.maintenance_txn(now, IDLE_SLICE, first) {
                Ok(d) => d,
                Err(e) => {
                    self.poison(e.clone());
                    return Err(e);
                }
            };
            first = false;
            let waiting = self.subs.iter().flatten().any(|s| {
                s.sealing.as_ref().is_some_and(|g| g.built.is_none())
                    || s.merging
                        .as_ref()
                        .is_some_and(|m| m.waiting_for_filter && m.filter.is_none())
            });
            if waiting {
                if let Ok(b) = self.built_rx.recv_timeout(Duration::from_secs(60)) {
                    self.attach_built(b);
                }
                continue;
            }
            if !did {
                return Ok(());
            }
        }
    }

    fn report(&self) -> Vec<SubscriberReport> {
        self.subs
            .iter()
            .flatten()
            .map(|st| {
                let (claims, active) = st.claims();
                SubscriberReport {
                    subscriber: st.name.to_string(),
                    claims,
                    active_claims: active,
                    sealed_generations: st.sealed.len() as u64,
                    quarantined: st.quarantined,
                    quarantine_records: st.records.quarantine.stored,
                    dead_lettered: st.dead_lettered,
                    dead_letter_records: st.records.dead_letter.stored,
                    filter_bytes: st.filter_bytes(),
                    index_bytes: st.index_bytes(),
                }
            })
            .collect()
    }
}

/// A subscriber's state on this shard, with the handler effects a crash or stop left in its
/// state log (see handlers.rs).
fn new_sub_state(spec: &super::Subscriber, db: &Database) -> Result<SubState, redb::Error> {
    let mut pending_log = Vec::new();
    LogRow::start(&mut pending_log);
    let mut st = SubState {
        id: spec.id,
        name: spec.name.clone(),
        ttl_ms: 0,
        sliding: false,
        active: None,
        sealing: None,
        sealed: Vec::new(),
        merging: None,
        next_order: 1,
        pending_log,
        quarantined: 0,
        dead_lettered: 0,
        records: Default::default(),
        max_attempts: 1,
        retry_backoff: Duration::ZERO,
        settings_epoch: 0,
        handler: None,
        view: None,
        state_buf: StateBuffer::load(db, &spec.name)?,
        probe: false,
        disk_mask: placement_mask(db, &spec.name)?,
        mask_pending: 0,
    };
    let kept = records::load(db, &spec.name)?;
    st.records = kept.records;
    st.quarantined = kept.quarantined;
    st.dead_lettered = kept.dead_lettered;
    apply_settings(&mut st, spec);
    Ok(st)
}

/// The placement bits this shard recorded for a subscriber.
fn placement_mask(db: &Database, subscriber: &str) -> Result<u8, redb::Error> {
    let txn = db.begin_read()?;
    let table = match txn.open_table(tables::PLACEMENTS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    Ok(table.get(subscriber)?.map(|v| v.value()).unwrap_or(0))
}

/// Takes a subscriber's current settings into its shard state (between batches).
fn apply_settings(st: &mut SubState, spec: &super::Subscriber) {
    st.settings_epoch = spec.settings_epoch();
    let settings = spec.settings();
    st.ttl_ms = settings.ttl.as_millis() as u64;
    st.sliding = settings.sliding_ttl;
    st.max_attempts = settings.max_attempts.max(1);
    st.retry_backoff = settings.retry_backoff;
}

/// Records a claim in the active generation (creating it if needed) and in the batch's
/// log row. Durable only once the batch commits.
/// The index is allocated at full size up front (growing a half-million-entry hash table
/// inside a batch was a measured 20-60 ms stall), preferably from the spare pool.
/// The placement bit a claim of `job` written on `shard` records: its placement's, or
/// [`placement::ANYWHERE`] when the job was decided away from the shard its placement
/// chooses.
fn placement_bit(job: &Job, shard: usize, count: usize, subscriber: &str) -> u8 {
    let home = match job.placement {
        Placement::ByKey => job.key,
        Placement::Subscriber => crate::envelope::key_hash(subscriber.as_bytes()),
        Placement::Entity => {
            crate::envelope::key_hash(job.entity.as_deref().unwrap_or_default().as_bytes())
        }
    };
    if super::route_hash(home, count) == shard {
        job.placement.bit()
    } else {
        placement::ANYWHERE
    }
}

fn insert_claim(
    st: &mut SubState,
    next_table_id: &mut u64,
    key: u128,
    claim: ClaimRecord,
    now: u64,
    presize: usize,
    spare: &mut Vec<KeyMap>,
) {
    let active = st.active.get_or_insert_with(|| {
        let id = *next_table_id;
        *next_table_id += 1;
        let order = st.next_order;
        st.next_order += 1;
        ActiveGen {
            table_id: id,
            order,
            map: spare
                .pop()
                .unwrap_or_else(|| KeyMap::with_capacity_and_hasher(presize, Default::default())),
            next_row: 0,
            created_at_ms: now,
        }
    });
    active.map.insert(key, claim);
    LogRow::push(&mut st.pending_log, key, &claim);
}

/// Deletes one quarantine or dead-letter record of a subscriber (the outcome stays counted).
fn remove_record(
    txn: &WriteTransaction,
    path: &std::path::Path,
    st: &mut SubState,
    kind: RecordKind,
    seq: u64,
) -> Result<bool, LedgerError> {
    records::remove(txn, st, kind, seq).map_err(|e| storage(path, e))
}

/// Sends each job's outcome to its source, grouped per source channel.
fn send_outcomes(done: Vec<(Job, Outcome)>) {
    let mut groups: Vec<(super::AckSender, Vec<Done>)> = Vec::new();
    for (job, outcome) in done {
        let d = Done {
            seq: job.seq,
            outcome,
        };
        match groups.iter_mut().find(|(tx, _)| tx.same_channel(&job.ack)) {
            Some((_, v)) => v.push(d),
            None => groups.push((job.ack, vec![d])),
        }
    }
    for (tx, v) in groups {
        let _ = tx.send(v);
    }
}
