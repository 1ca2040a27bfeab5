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
//!
//! This file holds the shard's types; each step lives in its own file:
//! - `writer.rs`: the writer thread and its loop (gather a batch, commit it, send outcomes
//!   in order, schedule retries; peers, control requests and maintenance between batches);
//! - `open.rs`: opening, format check and recovery;
//! - `decide.rs`: deciding a batch's jobs (I2 lookups) and committing it;
//! - `handle.rs`: a new message's handler call, its circuit breaker, and the claim, retry
//!   or dead letter its result decides;
//! - `replicate.rs`: changelog restores and snapshots, and handing a batch's changes and
//!   records to the changelog before it commits;
//! - `tally.rs`: a batch's counts per subscriber;
//! - `probe.rs`: asking the other shards about keys whose claims may be elsewhere;
//! - `write.rs`: writing a batch's claims, records and effects into its transaction;
//! - `maintain.rs`: sealing, expiry, retired logs and record retention, and when to merge;
//! - `merge.rs`: merging two sealed generations slice by slice;
//! - `control.rs`: requests answered between batches (lookups, records, outbox, backup);
//! - `sub_state.rs`: `SubState`, everything the shard knows about one subscriber, one
//!   part per product (claims, records, handling, placement, changelog), each defined in
//!   its product's folder;
//! - `breaker.rs`, `share.rs`: a subscriber's circuit breaker and fair share of the thread.

pub(crate) mod breaker;
mod control;
mod decide;
mod handle;
mod maintain;
mod merge;
mod open;
mod probe;
mod replicate;
mod share;
mod sub_state;
mod tally;
mod write;
mod writer;

pub(crate) use sub_state::SubState;
use writer::send_outcomes;
pub(crate) use writer::spawn;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};
use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableHandle,
    WriteTransaction,
};

use super::claims::block::{self, BlockError, BlockWriter};
use super::claims::filter::{FilterBuilder, GenFilter};
use super::claims::generation::{
    map_bytes, merge_slice, ActiveGen, BuildJob, Builder, Built, Found, KeyMap, MergeJob,
    SealedGen, SealingGen,
};
use super::claims::record::{ClaimRecord, GenMeta, GenState, LogRow, FORMAT_VERSION};
use super::claims::SubClaims;
use super::format::tables::{self, claims_def, log_def};
use super::placement::{self, Acquire, InFlight, Placement, SubPlacement};
use super::records::{self, PendingRecord};
use super::state::{self, BatchView, ShardHandler, StateBuffer, SubHandling};
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
    Sync {
        reply: Sender<Result<(), LedgerError>>,
    },
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
    OutboxLen {
        reply: Sender<Result<u64, LedgerError>>,
    },
    /// Puts a subscriber's quarantine and dead-letter records a changelog restore found
    /// (copies with a body) and removes those it found removed; answers how many it put.
    RecordsRestore {
        sub: SubscriberId,
        copies: Vec<crate::ledger::changelog::RecordCopy>,
        reply: Sender<Result<u64, LedgerError>>,
    },
    /// Appends a subscriber's emitted messages to the outbox (a changelog restore's).
    OutboxWrite {
        subscriber: String,
        messages: Vec<crate::effects::OutboxMessage>,
        reply: Sender<Result<(), LedgerError>>,
    },
    /// The sequence numbers of the oldest and the newest pending outbox row.
    OutboxSpan {
        reply: Sender<Result<Option<(u64, u64)>, LedgerError>>,
    },
    /// Reads a changelog checkpoint.
    Checkpoint {
        key: String,
        reply: Sender<Result<Option<u64>, LedgerError>>,
    },
    /// Writes changelog checkpoints, all in one transaction.
    SetCheckpoints {
        entries: Vec<(String, u64)>,
        reply: Sender<Result<(), LedgerError>>,
    },
    /// Starts recording the file's writes; answers the file's path, to copy.
    BackupBegin {
        reply: Sender<Result<PathBuf, LedgerError>>,
    },
    /// Stops recording and, once every shard's writer met at `meeting`, brings the copy at
    /// `dest` (if any) up to this commit boundary.
    BackupFinish {
        dest: Option<PathBuf>,
        meeting: Arc<crate::ledger::backends::tracked::Rendezvous>,
        reply: Sender<Result<crate::ledger::ShardCopy, LedgerError>>,
    },
}

pub(crate) struct ShardContext {
    pub(crate) path: PathBuf,
    pub(crate) index: usize,
    pub(crate) count: usize,
    pub(crate) config: LedgerConfig,
    pub(crate) registry: Arc<Registry>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) poison: Arc<super::poison::Poison>,
    pub(crate) metrics: Arc<Mutex<ShardMetrics>>,
    pub(crate) builder: Builder,
    /// Test-only fault injection (see `backends/fault.rs`).
    pub(crate) fault: Option<Arc<crate::ledger::backends::fault::FaultPlan>>,
    /// Every shard's peer channel, by index (set before `Ledger::open` returns).
    pub(crate) peers: Arc<std::sync::OnceLock<Vec<Sender<PeerMsg>>>>,
    /// Keys being decided with a probe, shared by all shards.
    pub(crate) inflight: Arc<InFlight>,
    /// What each shard holds of probing subscribers' claims (`presence.rs`).
    pub(crate) presences: Arc<crate::ledger::placement::presence::Presences>,
    /// The ranges of the file written while an online backup copies it (`backends/tracked.rs`).
    pub(crate) writes: Arc<crate::ledger::backends::tracked::WriteLog>,
    /// Durable commits of all shards (shared): what an online backup's copies are cut at.
    pub(crate) engine_commits: Arc<std::sync::atomic::AtomicU64>,
    /// This open created the data directory's manifest: only then is the shard file
    /// created and initialised; otherwise a missing or empty one is refused.
    pub(crate) create: bool,
    /// The newest engine time any shard committed (`engine_time_ms`), raised by each
    /// shard as it opens.
    pub(crate) time_mark: Arc<std::sync::atomic::AtomicU64>,
    /// Told what the open does (`opening.rs`); dropped once the shard is open.
    pub(crate) observer: Option<crate::ledger::OpenObserver>,
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
    /// Bytes of `spare_maps` last reported in the shard's metrics.
    spare_bytes: u64,
    /// The last transaction left the retired tables alone (`TRIM_DEFER_AFTER`); the next
    /// one trims them whatever else it did.
    trims_deferred: bool,

    /// A `Durability::None` commit of the gaps is not durable yet.
    undurable: bool,
    /// Log tables of sealed generations, emptied a few rows per batch. A crash leaves them
    /// as orphans that `recover` deletes.
    retired_logs: std::collections::VecDeque<String>,
    /// Claims tables of merged or expired generations, with the next of
    /// [`RETIRE_RANGES`] key ranges to empty. Deleting a table reads every page of it:
    /// 90-127 ms for ~2M claims inside one batch (measured at 30M messages), growing with
    /// the table. A crash leaves them as orphans that `recover` deletes.
    retired_claims: std::collections::VecDeque<RetiredClaims>,
    /// Messages whose handler failed and that wait for their next attempt.
    retries: std::collections::BinaryHeap<Retry>,
    retry_order: u64,
    /// Handler time per subscriber and messages set aside while over their share.
    shares: share::Shares,
    dead_rows: Vec<PendingRecord>,
    /// Records that replayed jobs of this batch settled, removed with its commit.
    settled: Vec<(RecordKind, SubscriberId, u64)>,
    next_outbox_seq: u64,
    /// Outbox rows at the last warning that they pile up (0: none yet).
    outbox_warned: u64,
    next_dead_seq: u64,
    /// Scratch message handed to handlers, reused between calls.
    handler_msg: HandlerMessage,
    /// The last successful call's effects, kept for its change when its subscriber
    /// publishes a changelog.
    last_effects: Option<crate::effects::Effects>,
    /// Probes sent to the other shards and the jobs waiting for their answers.
    probing: HashMap<u64, ProbeGroup>,
    next_group: u64,
    /// Keys of this batch decided without a probe while held in the in-flight set
    /// (`presence.rs`), given back after its commit.
    held_unprobed: Vec<(SubscriberId, u128)>,
    /// The subscriber handler state maintenance starts with in the next transaction, so a
    /// transaction's shared state budget reaches every subscriber in turn.
    next_state_turn: usize,
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
    /// Its subscriber used more than its share of this busy shard: set aside, without a
    /// call, until it is under its share again (`share.rs`).
    Defer,
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
/// A sealed claims table that could not be read: a storage error, or a damaged block
/// (reported with the table, never read as "absent").
pub(super) fn block_error(path: &std::path::Path, table: &str, e: BlockError) -> LedgerError {
    match e {
        BlockError::Storage(e) => storage(path, e),
        BlockError::Damaged(detail) => LedgerError::Corrupt {
            path: path.to_path_buf(),
            detail: format!("table {table}: {detail}"),
        },
    }
}

pub(super) fn storage(path: &std::path::Path, e: impl Into<redb::Error>) -> LedgerError {
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

/// Rows per slice of sealing/merging work inside a normal batch: at least twice the batch
/// so sealing outpaces the filling of the next generation, small enough to keep the batch
/// short.
fn slice_budget(batch_len: usize, behind: bool) -> usize {
    if behind {
        (batch_len * 2).max(BEHIND_SLICE)
    } else {
        batch_len * 2
    }
}

/// A batch of this many jobs commits without lingering (`Shard::gather`): its commit's
/// fixed cost is then about a microsecond of CPU a message.
const LINGER_BELOW: usize = 256;

/// The least maintenance a batch carries while maintenance is behind (see
/// [`Shard::maintenance_behind`]): so it always catches up, however small the batches.
const BEHIND_SLICE: usize = 8192;
/// Maintenance of one transaction in a gap between batches: about 2-3 ms of work, so a
/// message that arrives meanwhile waits for at most that.
const GAP_SLICE: usize = 2048;

const IDLE_SLICE: usize = 65_536;
/// Handler state work per transaction, in slice budgets, shared by all subscribers: one for
/// a flush and one for a merge.
const STATE_SLICES: usize = 2;
/// A retired claims table is emptied by this many equal ranges of the key hash (the top 9
/// bits), as many per transaction as the slice budget allows: about 16,000 claims (128
/// blocks) per range for the largest generations (8M claims).
const RETIRE_RANGES: u32 = 512;

/// Retired claims removed per transaction, in slice budgets. Every claim is retired once
/// per merge it goes through and once more when it expires, so retiring must remove
/// several times the claims a batch brings; removing a block of ~128 claims frees one
/// page. With one budget (8,192 claims, 64 pages) a soak at ~190,000 msgs/s queued
/// hundreds of retired tables and its files grew by ~5 MB/s.
const RETIRE_FACTOR: usize = 8;

/// A claims table waiting to be emptied and deleted (`trim_retired_claims`).
struct RetiredClaims {
    name: String,
    /// The claims it held.
    claims: u64,
    /// The next of [`RETIRE_RANGES`] to empty.
    next: u32,
}
/// Rows of a retired log removed per batch (each row is one earlier batch's claims).
const RETIRE_ROWS: usize = 4;
/// A batch whose subscribers' maintenance (a merge finish, a seal's last slice) already
/// took this long leaves the retired logs and claims tables to the next transaction, one
/// batch at a time: stacked in one batch, the two made the slowest batches at 100M claims
/// (a 20-48 ms merge finish plus a ~20 ms trim, and the commit).
const TRIM_DEFER_AFTER: Duration = Duration::from_millis(15);
const EXPIRY_CHECK_MS: u64 = 1000;

impl Shard {
    fn err(&self, e: impl Into<redb::Error>) -> LedgerError {
        storage(&self.ctx.path, e)
    }

    fn corrupt(&self, detail: String) -> LedgerError {
        LedgerError::Corrupt {
            path: self.ctx.path.clone(),
            detail,
        }
    }
}
