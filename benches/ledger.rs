//! Micro-benchmarks of the ledger's hot pieces through its public API, with fixed seeds:
//! a batch of claims decided and committed (new ids, and redeliveries found in sealed
//! generations), sealing a generation, and a handler's state reads. `cargo bench --bench
//! ledger`.
//!
//! The data directory is on tmpfs (`/dev/shm`) when the machine has one, so an fsync costs
//! next to nothing and the figures are the engine's CPU per batch; the durable end-to-end
//! figure is `dedupd bench`. Every batch's outcomes are checked (processed or duplicate as
//! expected, the handler's reads found), so a batch that fails fast cannot pass for a fast one.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use crossbeam_channel::unbounded;
use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::effects::StateReader;
use dedupd::effects::{Effects, Failure, HandlerFactory, HandlerMessage, MessageHandler};
use dedupd::envelope::key_hash;
use dedupd::ledger::{Done, Job, Ledger, Outcome};
use rand::{rngs::SmallRng, Rng, SeedableRng};

const SEED: u64 = 42;
const BATCH: usize = 1_000;
/// Claims (and state entries) in the store before the measured batches.
const STORED: u64 = 500_000;

fn scratch() -> tempfile::TempDir {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        if let Ok(d) = tempfile::tempdir_in(&shm) {
            return d;
        }
    }
    tempfile::tempdir().expect("a scratch directory")
}

fn open(dir: &std::path::Path, extra: &str) -> Ledger {
    let config = Config::parse(&format!("[ledger]\nshards = 2\n{extra}")).expect("config");
    Ledger::open(&dir.join("data"), &config, Arc::new(SystemClock)).expect("open")
}

fn id(n: u64) -> String {
    format!("msg-{n:012}")
}

/// Submits `ids` (payload: the id) to their shards, one batch per shard, and waits for
/// every outcome; panics unless each is `want`.
fn submit(ledger: &Ledger, sub: &str, ids: &[String], want: &Outcome) {
    let s = ledger.subscriber(sub).expect("subscriber");
    let (tx, rx) = unbounded::<Vec<Done>>();
    let mut per_shard: Vec<Vec<Job>> = (0..ledger.shard_count()).map(|_| Vec::new()).collect();
    for (i, id) in ids.iter().enumerate() {
        let key = key_hash(id.as_bytes());
        let mut job = Job::new(i as u64, s.id, key, 1, id, id.as_bytes(), tx.clone());
        // Routed as the sources route: by key, or to the handler's one store.
        let shard = ledger.place(&s, &mut job, None);
        per_shard[shard].push(job);
    }
    drop(tx);
    for (shard, jobs) in per_shard.into_iter().enumerate() {
        if !jobs.is_empty() {
            ledger.submit(shard, jobs).expect("submit");
        }
    }
    let mut n = 0;
    for done in rx.iter().flatten() {
        assert_eq!(&done.outcome, want, "{}", ids[done.seq as usize]);
        n += 1;
    }
    assert_eq!(n, ids.len(), "every message has an outcome");
}

/// Times `iters` batches of `BATCH` ids never sent before (taken from `next`), each
/// processed; building the ids is not timed.
fn new_batches(ledger: &Ledger, sub: &str, next: &AtomicU64, iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let first = next.fetch_add(BATCH as u64, Ordering::Relaxed);
        let ids: Vec<String> = (first..first + BATCH as u64).map(id).collect();
        let t = Instant::now();
        submit(ledger, sub, &ids, &Outcome::Processed);
        total += t.elapsed();
    }
    total
}

/// Stores `count` claims from `first` on, in batches.
fn fill(ledger: &Ledger, sub: &str, first: u64, count: u64) {
    let ids: Vec<String> = (first..first + count).map(id).collect();
    for chunk in ids.chunks(10 * BATCH) {
        submit(ledger, sub, chunk, &Outcome::Processed);
    }
}

fn claims(c: &mut Criterion) {
    let dir = scratch();
    let ledger = open(dir.path(), "");
    fill(&ledger, "bench", 0, STORED);
    ledger.maintain(true).expect("seal");
    eprintln!("claims: {STORED} claims sealed, batches of {BATCH}, seed {SEED}");
    let next = AtomicU64::new(STORED);
    let mut rng = SmallRng::seed_from_u64(SEED);
    let mut g = c.benchmark_group("claim");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.sample_size(20);
    g.bench_function("decide_commit_new_1000", |b| {
        b.iter_custom(|iters| new_batches(&ledger, "bench", &next, iters))
    });
    g.bench_function("decide_redelivered_sealed_1000", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let ids: Vec<String> = (0..BATCH)
                    .map(|_| id(rng.random_range(0..STORED)))
                    .collect();
                let t = Instant::now();
                submit(&ledger, "bench", &ids, &Outcome::Duplicate);
                total += t.elapsed();
            }
            total
        })
    });
    g.finish();
}

fn seal(c: &mut Criterion) {
    const CLAIMS: u64 = 100_000;
    let mut g = c.benchmark_group("seal");
    g.throughput(Throughput::Elements(CLAIMS));
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(20));
    g.bench_function("seal_100k_claims", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                // A fresh store each time, so every seal does the same work.
                let dir = scratch();
                let ledger = open(dir.path(), "");
                fill(&ledger, "bench", 0, CLAIMS);
                let t = Instant::now();
                ledger.maintain(true).expect("seal");
                total += t.elapsed();
                let report = ledger.report().expect("report");
                let sealed: u64 = report
                    .subscribers
                    .iter()
                    .map(|s| s.sealed_generations)
                    .sum();
                assert!(sealed > 0, "nothing was sealed");
            }
            total
        })
    });
    g.finish();
}

/// Reads `k/<n>` for the `n` in the payload (`msg-<n>`) and writes nothing; `Writes` puts
/// it. With `reads: false`, reads nothing (the same batch without state reads).
#[derive(Debug, Clone, Copy)]
struct KeyHandler {
    write: bool,
    reads: bool,
    stored: u64,
}

fn state_key(n: u64) -> Vec<u8> {
    format!("k/{n:012}").into_bytes()
}

impl MessageHandler for KeyHandler {
    fn handle(
        &mut self,
        msg: &HandlerMessage,
        state: Box<dyn StateReader>,
    ) -> (Box<dyn StateReader>, Result<Effects, Failure>) {
        let n: u64 = std::str::from_utf8(&msg.payload)
            .ok()
            .and_then(|p| p.trim_start_matches("msg-").parse().ok())
            .expect("payload msg-<n>");
        let mut e = Effects::default();
        if self.write {
            e.state.insert(state_key(n), Some(n.to_le_bytes().to_vec()));
        } else if self.reads {
            // A key stored before the measurement, spread over the whole store.
            let k = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) % self.stored;
            let found = state.get(&state_key(k));
            assert_eq!(found, Some(k.to_le_bytes().to_vec()), "state read of k/{k}");
        }
        (state, Ok(e))
    }
}

impl HandlerFactory for KeyHandler {
    fn instantiate(&self) -> Result<Box<dyn MessageHandler>, String> {
        Ok(Box::new(*self))
    }
    fn version(&self) -> u64 {
        u64::from(self.write) * 2 + u64::from(self.reads) + 1
    }
}

fn state(c: &mut Criterion) {
    let dir = scratch();
    // A small buffer, so the stored entries are in sorted runs, as at scale.
    let ledger = open(dir.path(), "state_buffer_entries = 4096\n");
    let handler = |write, reads| -> Arc<dyn HandlerFactory> {
        Arc::new(KeyHandler {
            write,
            reads,
            stored: STORED,
        })
    };
    ledger
        .set_handler("state", Some(handler(true, false)))
        .expect("handler");
    fill(&ledger, "state", 0, STORED);
    ledger.maintain(true).expect("flush and merge");
    eprintln!("state: {STORED} entries in runs, batches of {BATCH}, seed {SEED}");
    let next = AtomicU64::new(STORED);
    let mut g = c.benchmark_group("state");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.sample_size(20);
    for (name, reads) in [
        ("handler_no_read_1000", false),
        ("handler_get_hit_1000", true),
    ] {
        ledger
            .set_handler("state", Some(handler(false, reads)))
            .expect("handler");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| new_batches(&ledger, "state", &next, iters))
        });
    }
    g.finish();
}

criterion_group!(benches, claims, seal, state);
criterion_main!(benches);
