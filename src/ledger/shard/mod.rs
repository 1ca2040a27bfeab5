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
//! This file holds the shard's types and its writer loop (gather a batch, commit it, send
//! outcomes, schedule retries); each step lives in its own file:
//! - `open.rs`: opening, format check and recovery;
//! - `decide.rs`: deciding a batch's jobs (I2 lookups, handler calls) and committing it;
//! - `probe.rs`: asking the other shards about keys whose claims may be elsewhere;
//! - `write.rs`: writing a batch's claims, records and effects into its transaction;
//! - `maintain.rs`: sealing, expiry, retired logs and record retention, and when to merge;
//! - `merge.rs`: merging two sealed generations slice by slice;
//! - `control.rs`: requests answered between batches (lookups, records, outbox, backup).

pub(super) mod breaker;
mod control;
mod decide;
mod maintain;
mod merge;
mod open;
mod probe;
mod share;
mod write;

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

use super::claimblock::{self, BlockError, BlockWriter};
use super::filter::{FilterBuilder, GenFilter};
use super::generation::{
    map_bytes, merge_slice, ActiveGen, BuildJob, Builder, Built, Found, KeyMap, MergeJob,
    SealedGen, SealingGen, SubState,
};
use super::placement::{self, Acquire, InFlight, Placement};
use super::record::{ClaimRecord, GenMeta, GenState, LogRow, FORMAT_VERSION};
use super::records::{self, PendingRecord};
use super::state::{self, BatchView, ShardHandler, StateBuffer};
use super::tables::{self, claims_def, log_def};
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
        meeting: Arc<crate::ledger::tracked::Rendezvous>,
        reply: Sender<Result<crate::ledger::ShardCopy, LedgerError>>,
    },
}

pub(crate) struct ShardContext {
    pub path: PathBuf,
    pub index: usize,
    pub count: usize,
    pub config: LedgerConfig,
    pub registry: Arc<Registry>,
    pub clock: Arc<dyn Clock>,
    pub poison: Arc<super::poison::Poison>,
    pub metrics: Arc<Mutex<ShardMetrics>>,
    pub builder: Builder,
    /// Test-only fault injection (see `fault.rs`).
    pub fault: Option<Arc<crate::ledger::fault::FaultPlan>>,
    /// Every shard's peer channel, by index (set before `Ledger::open` returns).
    pub peers: Arc<std::sync::OnceLock<Vec<Sender<PeerMsg>>>>,
    /// Keys being decided with a probe, shared by all shards.
    pub inflight: Arc<InFlight>,
    /// What each shard holds of probing subscribers' claims (`presence.rs`).
    pub presences: Arc<crate::ledger::presence::Presences>,
    /// The ranges of the file written while an online backup copies it (`tracked.rs`).
    pub writes: Arc<crate::ledger::tracked::WriteLog>,
    /// Durable commits of all shards (shared): what an online backup's copies are cut at.
    pub engine_commits: Arc<std::sync::atomic::AtomicU64>,
    /// This open created the data directory's manifest: only then is the shard file
    /// created and initialised; otherwise a missing or empty one is refused.
    pub create: bool,
    /// The newest engine time any shard committed (`engine_time_ms`), raised by each
    /// shard as it opens.
    pub time_mark: Arc<std::sync::atomic::AtomicU64>,
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

/// The least maintenance a batch carries while maintenance is behind (see
/// [`Shard::maintenance_behind`]): so it always catches up, however small the batches.
const BEHIND_SLICE: usize = 8192;
/// Maintenance of one transaction in a gap between batches (the queue empty): about
/// 2-3 ms of work, so a message that arrives meanwhile waits for at most that.
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

    /// The writer loop. Returns when told to stop or when every sender is gone.
    /// Answers every probe and takes every reply already queued (between batches, so only
    /// committed claims are reported).
    fn serve_peers(&mut self, peer_rx: &Receiver<PeerMsg>) {
        while let Ok(m) = peer_rx.try_recv() {
            self.peer(m);
        }
    }

    pub fn run(mut self, rx: Receiver<ShardMsg>, peer_rx: Receiver<PeerMsg>) {
        let tick = Duration::from_millis(50);
        loop {
            // Peers first: a probe waiting behind a batch of ours holds the asking shard's
            // messages for a whole batch and fsync (I6).
            self.serve_peers(&peer_rx);
            let mut wait = match self.retries.peek() {
                Some(r) => r.due.saturating_duration_since(Instant::now()).min(tick),
                None => tick,
            };
            if self.shares.has_deferred() {
                wait = wait.min(share::RECHECK);
            }
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
                    if self.batch.is_empty() && !self.shares.has_deferred() {
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
                    self.serve_peers(&peer_rx);
                    self.process_batch();
                    if deferred.is_none() {
                        self.gap_maintenance(&rx, &peer_rx);
                    }
                    deferred
                }
                // Answers completed a probe: decide those jobs with whatever else is queued.
                None if !self.batch.is_empty() => {
                    let deferred = self.gather(&rx);
                    self.serve_peers(&peer_rx);
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

    fn poison(&mut self, e: LedgerError) {
        tracing::error!(shard = self.ctx.index, error = %e, "the shard stops acknowledging");
        self.ctx.poison.set(e.to_string());
        self.failed = Some(e);
    }

    /// Decides and commits the gathered batch, then sends its outcomes, schedules its
    /// retries and sends its probes. After a failed commit every waiting job fails (I4).
    fn process_batch(&mut self) {
        let started = Instant::now();
        let mut jobs = std::mem::take(&mut self.batch);
        self.shares.begin_batch(&mut jobs, started);
        if jobs.is_empty() {
            // Only set-aside messages, all still over their share.
            self.batch = jobs;
            self.idle();
            return;
        }
        let now = self.ctx.clock.now_ms();
        for job in jobs.iter_mut().filter(|j| j.received_at_ms == 0) {
            job.received_at_ms = now;
        }
        if self.failed.is_none() && self.ctx.poison.is_set() {
            // Another shard failed: the whole ledger stops acknowledging (G7).
            let reason = self.ctx.poison.reason().unwrap_or_default();
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
        // Committed (or failed, and the shard stops): the keys decided without a probe
        // go back to the in-flight set.
        // Counted before the outcomes go out, so whoever saw every outcome sees the count.
        let unprobed = self.held_unprobed.len() as u64;
        if unprobed > 0 {
            self.ctx
                .metrics
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .unprobed_keys += unprobed;
        }
        self.ctx
            .inflight
            .release(self.held_unprobed.drain(..), self.ctx.index);
        match decisions {
            Ok(decisions) => self.follow_decisions(&mut jobs, decisions),
            Err(e) => self.fail_all(&mut jobs, &e),
        }
        metrics::histogram!(crate::telemetry::metric::BATCH_DURATION_SECONDS, "shard" => self.ctx.index.to_string())
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

    /// Acts on a committed batch's decisions: outcomes to their sources, failed handler
    /// calls and jobs waiting for their key to the retry queue, probes to the other shards.
    fn follow_decisions(&mut self, jobs: &mut Vec<Job>, decisions: Vec<Decision>) {
        let mut done = Vec::with_capacity(jobs.len());
        let mut probes = Vec::new();
        let mut decided_elsewhere = Vec::new();
        for (mut job, d) in jobs.drain(..).zip(decisions) {
            // The batch that used the other shards' answer committed: give the key
            // back (a retried job asks again next time).
            if job.probed.take().is_some() {
                decided_elsewhere.push((job.subscriber, job.key));
            }
            match d {
                Decision::Done(outcome) => done.push((job, outcome)),
                Decision::Probe => probes.push(job),
                Decision::Wait => self.retry_after(job, WAIT_FOR_KEY),
                Decision::Defer => self.shares.defer(job),
                Decision::Retry(failure) => {
                    let delay = match &failure {
                        // Back when the breaker lets a call through again (a millisecond
                        // late rather than early: the breaker reads the ledger's clock).
                        Failure::CircuitOpen { retry_in_ms, .. } => {
                            Duration::from_millis(retry_in_ms.saturating_add(1))
                        }
                        _ => self.subs[job.subscriber.0 as usize]
                            .as_ref()
                            .map_or(Duration::from_millis(50), |s| {
                                decide::retry_delay(s.retry_backoff, s.max_backoff, job.attempt)
                            }),
                    };
                    tracing::debug!(shard = self.ctx.index, id = %job.id, attempt = job.attempt,
                        error = %failure, "handler failed; retrying after {delay:?}");
                    job.attempt += 1;
                    self.retry_after(job, delay);
                }
            }
        }
        self.ctx.inflight.release(decided_elsewhere, self.ctx.index);
        self.count_acks(&done);
        send_outcomes(done);
        self.send_probes(probes);
    }

    /// Adds the decided jobs' latencies to their subscribers' counters, one atomic add
    /// per subscriber and batch.
    fn count_acks(&self, done: &[(Job, Outcome)]) {
        let mut per_sub: Vec<(SubscriberId, u64, u64)> = Vec::new();
        let now = Instant::now();
        for (job, _) in done {
            let us = now.saturating_duration_since(job.created).as_micros() as u64;
            match per_sub.iter_mut().find(|(s, _, _)| *s == job.subscriber) {
                Some((_, n, sum)) => {
                    *n += 1;
                    *sum += us;
                }
                None => per_sub.push((job.subscriber, 1, us)),
            }
        }
        for (sub, n, sum) in per_sub {
            if let Some(spec) = self.ctx.registry.get(sub) {
                spec.counters.acked.fetch_add(n, Ordering::Relaxed);
                spec.counters
                    .ack_latency_us
                    .fetch_add(sum, Ordering::Relaxed);
            }
        }
    }

    fn retry_after(&mut self, job: Job, delay: Duration) {
        self.retry_order += 1;
        self.retries.push(Retry {
            due: Instant::now() + delay,
            order: self.retry_order,
            job,
        });
    }

    /// After a failed batch (or on a failed shard): the batch's jobs, jobs waiting for
    /// probe answers and jobs waiting for a retry all fail, since none will be decided.
    fn fail_all(&mut self, jobs: &mut Vec<Job>, e: &LedgerError) {
        let reason = e.to_string();
        self.ctx.inflight.release_all(self.ctx.index);
        let waiting: Vec<Job> = self.probing.drain().flat_map(|(_, g)| g.jobs).collect();
        let retrying: Vec<Job> = self
            .retries
            .drain()
            .map(|r| r.job)
            .chain(self.shares.take_deferred())
            .collect();
        let failed = |j| {
            (
                j,
                Outcome::Failed {
                    reason: reason.clone(),
                },
            )
        };
        let done = waiting
            .into_iter()
            .map(failed)
            .chain(jobs.drain(..).map(failed))
            .chain(retrying.into_iter().map(failed))
            .collect();
        send_outcomes(done);
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
            if let Some(copies) = st.record_copies.as_mut() {
                copies.clear();
            }
        }
    }
}

/// Starts a shard's writer thread: it opens the shard (reporting the result on `ready`),
/// then runs the writer loop until stopped. A panic while opening is reported as a
/// corrupt file; one in the loop outside a batch stops the whole ledger (I4), so no dead
/// shard hides behind a ledger that reads as ready.
pub(crate) fn spawn(
    ctx: ShardContext,
    rx: Receiver<ShardMsg>,
    peer_rx: Receiver<PeerMsg>,
    ready_tx: Sender<Result<Arc<Database>, LedgerError>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let index = ctx.index;
    std::thread::Builder::new()
        .name(format!("dedupd-shard-{index}"))
        .spawn(move || {
            let path = ctx.path.clone();
            let poison = ctx.poison.clone();
            // redb may panic on a file damaged outside it (when `verify_on_open`
            // is off); that is corruption to report, not a crash.
            let opened =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Shard::open(ctx)))
                    .unwrap_or_else(|panic| {
                        Err(LedgerError::Corrupt {
                            path: path.clone(),
                            detail: super::panic_message(&*panic),
                        })
                    });
            match opened {
                Ok(shard) => {
                    // Readers (record pages) open their own read transactions on it,
                    // off the writer thread.
                    let _ = ready_tx.send(Ok(shard.db.clone()));
                    // A batch catches its own panics (`Shard::process_batch`); one
                    // anywhere else in the loop must stop the ledger too (I4), not
                    // leave a dead shard behind a ledger that reads as ready.
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        shard.run(rx, peer_rx)
                    }));
                    if let Err(panic) = ran {
                        let e = LedgerError::Panicked {
                            path,
                            detail: super::panic_message(&*panic),
                        };
                        tracing::error!(shard = index, error = %e, "the shard stopped");
                        poison.set(e.to_string());
                    }
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
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
