//! Crash test: `kill -9` the pipe process in the middle of a stream, again and again, with
//! the stream redelivered from its start after every restart (as a broker does for
//! unacknowledged messages), then one complete run. Each killed run is fed a prefix a few
//! thousand lines longer than its kill point (the broker has that much so far), and every
//! kill at a line count is followed by a kill after a random delay on the same input.
//!
//! Checked across all runs:
//! - every outcome line that was printed before a kill stays true: an id acked as
//!   `processed` (or `duplicate`) is `duplicate` in every later run (G1, durable acks);
//! - each unique `(subscriber, id)` is `processed` at most once over all runs (G2), and
//!   none is lost: each one is `processed` in exactly one run, except those whose claim was
//!   committed by a run that was killed before it printed the outcome; those must have been
//!   fed to that run after its last printed line, and are `duplicate` from then on;
//! - the store holds exactly one claim per unique `(subscriber, id)`;
//! - the final run prints one outcome line per input line, in order, and exits 0.
//!
//! The stream is generated from a seed (splitmix64). Set `DEDUPD_CRASH_SEED` to replay one;
//! the seed is printed when the test fails.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_dedupd");
/// Seeds per test when `DEDUPD_CRASH_SEED` is not set: base, base + 1, ...
const SEEDS_PER_TEST: u64 = 3;
const LINES: usize = 60_000;
const SUBSCRIBERS: [&str; 2] = ["orders", "ledger-sync"];
/// Kills after about this many outcome lines were read (jittered by the seed). The first
/// one lands right after the ledger opened.
const KILL_AFTER: [usize; 6] = [150, 5_000, 17_000, 30_000, 41_000, 50_000];
/// A killed run is fed this many lines beyond its kill point (the broker has only so much
/// yet), so every run meets ids no earlier run saw, and kills land amid first claims.
const FED_BEYOND_KILL: usize = 6_000;
/// A run that takes longer than this is killed and the test fails (no hanging CI).
const RUN_DEADLINE: Duration = Duration::from_secs(60);

struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One `(subscriber index, id number)` pair.
type Key = (usize, u64);

struct Stream {
    /// The input lines, each ending in a newline.
    text: Vec<String>,
    /// The key of each line.
    keys: Vec<Key>,
    /// Index of the line where each key first appears.
    first_line: HashMap<Key, usize>,
}

fn id_text(n: u64) -> String {
    format!("evt-{n:06}")
}

/// About a third of the lines are new ids; the rest redeliver an earlier line, mostly a
/// recent one. Redeliveries carry the same payload, sometimes encoded with another key
/// order or spacing. The two subscribers use the same id strings with other payloads.
fn generate(seed: u64) -> Stream {
    let mut rng = SplitMix64(seed);
    let mut next_id = [0u64; SUBSCRIBERS.len()];
    let mut keys: Vec<Key> = Vec::with_capacity(LINES);
    let mut text = Vec::with_capacity(LINES);
    let mut first_line = HashMap::new();
    for line in 0..LINES {
        let key = if keys.is_empty() || rng.below(3) == 0 {
            let sub = rng.below(SUBSCRIBERS.len() as u64) as usize;
            next_id[sub] += 1;
            (sub, next_id[sub])
        } else if rng.below(8) == 0 {
            keys[rng.below(keys.len() as u64) as usize]
        } else {
            let back = 1 + rng.below(keys.len().min(4096) as u64) as usize;
            keys[keys.len() - back]
        };
        first_line.entry(key).or_insert(line);
        let (sub, n) = key;
        let amount = (n * 7919 + sub as u64 * 104_729) % 100_003;
        let id = id_text(n);
        let s = SUBSCRIBERS[sub];
        let body = match rng.below(3) {
            0 => format!(
                r#"{{"subscriber":"{s}","id":"{id}","payload":{{"amount":{amount},"n":{n},"tags":["a","b"]}}}}"#
            ),
            1 => format!(
                r#"{{"id":"{id}","payload":{{"tags":["a","b"],"n":{n},"amount":{amount}}},"subscriber":"{s}"}}"#
            ),
            _ => format!(
                r#"{{ "payload" : {{ "n" : {n}, "amount" : {amount}, "tags" : [ "a", "b" ] }}, "id" : "{id}", "subscriber" : "{s}" }}"#
            ),
        };
        text.push(body + "\n");
        keys.push(key);
    }
    Stream {
        text,
        keys,
        first_line,
    }
}

/// When a run is killed.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// Once this many outcome lines were read.
    AfterLines(usize),
    /// This long after the start, whatever it is doing (opening, recovering, deciding).
    AfterDelay(Duration),
}

struct RunResult {
    /// `outcome` of each complete outcome line read, in order (line i is seq i+1).
    outcomes: Vec<String>,
    /// Input lines handed to the process's stdin (an upper bound of what it read).
    fed: usize,
    status: ExitStatus,
    stderr: String,
    /// A line cut off by the kill (never counts as an ack).
    partial_tail: bool,
}

fn locked(child: &Mutex<Child>) -> std::sync::MutexGuard<'_, Child> {
    child.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs pipe mode over the first `feed` lines of the stream. With `kill_after`, stdin stays
/// open after the last line and the process gets SIGKILL once that many outcome lines were
/// read; every line it printed before dying is still read (a broker saw those acks).
fn run_once(
    dir: &Path,
    config: &Path,
    stream: &Arc<Vec<String>>,
    feed: usize,
    kill: Option<Kill>,
) -> RunResult {
    let mut child = Command::new(BIN)
        .arg("pipe")
        .arg("--data-dir")
        .arg(dir)
        .arg("--config")
        .arg(config)
        .env("RUST_BACKTRACE", "0")
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dedupd");
    let stdin = child.stdin.take().expect("stdin");
    let stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let child = Arc::new(Mutex::new(child));

    // stdin on its own thread, so a full stdout pipe can never block us both.
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let lines = Arc::clone(stream);
    let keep_open = kill.is_some();
    let feeder = std::thread::spawn(move || {
        let mut w = BufWriter::with_capacity(1 << 16, stdin);
        let mut fed = 0;
        for l in lines.iter().take(feed) {
            if w.write_all(l.as_bytes()).is_err() {
                return fed;
            }
            fed += 1;
        }
        if w.flush().is_ok() && keep_open {
            // Hold stdin open: the process must be killed mid-stream, not reach EOF.
            let _ = release_rx.recv();
        }
        fed
    });
    let stderr_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
        s
    });
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let timed_out = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let child = Arc::clone(&child);
        let timed_out = Arc::clone(&timed_out);
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = done_rx.recv_timeout(RUN_DEADLINE) {
                timed_out.store(true, Ordering::SeqCst);
                let _ = locked(&child).kill();
            }
        })
    };

    let delayed_kill = match kill {
        Some(Kill::AfterDelay(d)) => {
            let child = Arc::clone(&child);
            Some(std::thread::spawn(move || {
                std::thread::sleep(d);
                // The child is reaped only after this thread is joined, so its pid is
                // still ours even if it already died.
                locked(&child).kill().expect("kill dedupd");
            }))
        }
        _ => None,
    };
    let kill_after = match kill {
        Some(Kill::AfterLines(n)) => Some(n),
        _ => None,
    };
    let mut reader = BufReader::with_capacity(1 << 16, stdout);
    let mut outcomes = Vec::new();
    let mut partial_tail = false;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader.read_until(b'\n', &mut buf).expect("read stdout");
        if n == 0 {
            break;
        }
        if buf.last() != Some(&b'\n') {
            partial_tail = true;
            break;
        }
        let v: Value = serde_json::from_slice(&buf).unwrap_or_else(|e| {
            panic!(
                "outcome line is not JSON ({e}): {}",
                String::from_utf8_lossy(&buf)
            )
        });
        let seq = outcomes.len() + 1;
        assert_eq!(v["seq"].as_u64(), Some(seq as u64), "outcome order: {v}");
        outcomes.push((v, seq));
        if kill_after == Some(outcomes.len()) {
            // std's Child::kill is SIGKILL on Unix.
            locked(&child).kill().expect("kill dedupd");
        }
    }
    if let Some(t) = delayed_kill {
        t.join().expect("kill thread");
    }
    let status = locked(&child).wait().expect("wait dedupd");
    drop(release_tx);
    drop(done_tx);
    let fed = feeder.join().expect("feeder thread");
    watchdog.join().expect("watchdog thread");
    let stderr = stderr_reader.join().expect("stderr thread");
    assert!(
        !timed_out.load(Ordering::SeqCst),
        "run did not finish within {RUN_DEADLINE:?} (kill {kill:?}, {} outcomes read); stderr:\n{stderr}",
        outcomes.len()
    );
    let outcomes = outcomes
        .into_iter()
        .map(|(v, seq)| {
            let name = v["outcome"].as_str().expect("outcome").to_string();
            assert!(
                v.get("reason").is_some(),
                "line {seq} has a reason field: {v}"
            );
            name
        })
        .collect();
    RunResult {
        outcomes,
        fed,
        status,
        stderr,
        partial_tail,
    }
}

/// Prints the seed if the test panics.
struct SeedGuard(u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "crash test failed with seed {:#x} (replay: DEDUPD_CRASH_SEED={})",
                self.0, self.0
            );
        }
    }
}

/// `DEDUPD_CRASH_SEED` alone, or `SEEDS_PER_TEST` seeds from `base`.
fn seeds(base: u64) -> Vec<u64> {
    match std::env::var("DEDUPD_CRASH_SEED") {
        Ok(s) => {
            let s = s.trim();
            let seed = match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            }
            .expect("DEDUPD_CRASH_SEED is a number");
            vec![seed]
        }
        Err(_) => (0..SEEDS_PER_TEST).map(|i| base.wrapping_add(i)).collect(),
    }
}

/// Per subscriber: (claims, quarantined, sealed generations), from `dedupd inspect`
/// (read-only: the engine's last run closed the files).
fn claims_per_subscriber(dir: &Path) -> HashMap<String, (u64, u64, u64)> {
    let out = Command::new(BIN)
        .args(["inspect", "--json", "--data-dir"])
        .arg(dir)
        .output()
        .expect("run dedupd inspect");
    assert!(
        out.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("inspect JSON");
    report["subscribers"]
        .as_array()
        .expect("subscribers")
        .iter()
        .map(|s| {
            (
                s["subscriber"].as_str().expect("name").to_string(),
                (
                    s["claims"].as_u64().expect("claims"),
                    s["quarantined"].as_u64().expect("quarantined"),
                    s["sealed_generations"]
                        .as_u64()
                        .expect("sealed_generations"),
                ),
            )
        })
        .collect()
}

/// Runs the kill plan for one seed. `expect_sealed`: the config makes generations small
/// enough that the final store must hold sealed generations.
fn crash_scenario(config_text: &str, seed: u64, expect_sealed: bool) {
    let _guard = SeedGuard(seed);
    let started = Instant::now();
    let stream = generate(seed);
    let unique: HashSet<Key> = stream.keys.iter().copied().collect();
    let lines = Arc::new(stream.text.clone());

    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("data");
    let config = tmp.path().join("dedupd.toml");
    std::fs::write(&config, config_text).expect("write config");

    let mut jitter = SplitMix64(seed ^ 0x0C0F_FEE0);
    // (when to kill, lines fed); the last run is complete. After each kill at a line count
    // the same input is redelivered to a run killed after a random delay, which may land
    // while the ledger opens and recovers what the previous kill left.
    let mut plan: Vec<(Option<Kill>, usize)> = Vec::new();
    for k in KILL_AFTER {
        let k = k + jitter.below(k as u64 / 8 + 1) as usize;
        let feed = (k + FED_BEYOND_KILL).min(LINES);
        plan.push((Some(Kill::AfterLines(k)), feed));
        let delay = Duration::from_millis(5 + jitter.below(300));
        plan.push((Some(Kill::AfterDelay(delay)), feed));
    }
    plan.push((None, LINES));

    // Every key that some printed outcome line has shown to be claimed, and in which run.
    let mut claimed: HashMap<Key, usize> = HashMap::new();
    let mut processed_in: Vec<HashSet<Key>> = Vec::new();
    // Keys whose claim was committed by a killed run that never printed it.
    let mut lost_acks: HashSet<Key> = HashSet::new();
    // (outcome lines printed, lines fed) of each killed run.
    let mut killed_runs: Vec<(usize, usize)> = Vec::new();
    let mut last = None;

    for (run, (kill, feed)) in plan.iter().copied().enumerate() {
        let t = Instant::now();
        let r = run_once(&dir, &config, &lines, feed, kill);
        let mut processed = HashSet::new();
        for (i, outcome) in r.outcomes.iter().enumerate() {
            let key = stream.keys[i];
            let ctx = || {
                format!(
                    "run {run}, line {} ({} {})",
                    i + 1,
                    SUBSCRIBERS[key.0],
                    id_text(key.1)
                )
            };
            match outcome.as_str() {
                "processed" => {
                    if let Some(earlier) = claimed.get(&key) {
                        panic!(
                            "{}: processed again, already claimed as of run {earlier}",
                            ctx()
                        );
                    }
                    claimed.insert(key, run);
                    processed.insert(key);
                }
                "duplicate" => {
                    if let Entry::Vacant(slot) = claimed.entry(key) {
                        // Claimed by a killed run after its last printed line, or a false
                        // duplicate. Only the former is possible if it was fed then.
                        let first = stream.first_line[&key];
                        let fed_unacked = killed_runs
                            .iter()
                            .any(|&(printed, fed)| printed <= first && first < fed);
                        assert!(
                            fed_unacked,
                            "{}: duplicate, but no earlier run acked or could have claimed it \
                             (first line {}; killed runs printed/fed {killed_runs:?})",
                            ctx(),
                            first + 1
                        );
                        assert_eq!(
                            first,
                            i,
                            "{}: first seen as duplicate after its first line",
                            ctx()
                        );
                        lost_acks.insert(key);
                        slot.insert(run);
                    }
                }
                other => panic!("{}: unexpected outcome {other}", ctx()),
            }
        }
        eprintln!(
            "run {run}: kill {kill:?}: {} outcome lines read, {} lines fed, {} processed, {:?} ({:.1}s)",
            r.outcomes.len(),
            r.fed,
            processed.len(),
            r.status,
            t.elapsed().as_secs_f64()
        );
        assert!(
            !r.stderr.contains("panicked"),
            "run {run} panicked:\n{}",
            r.stderr
        );
        match kill {
            Some(kill) => {
                assert_eq!(
                    r.status.signal(),
                    Some(9),
                    "run {run} must die of the SIGKILL, mid-stream; stderr:\n{}",
                    r.stderr
                );
                let at_least = match kill {
                    Kill::AfterLines(k) => k,
                    Kill::AfterDelay(_) => 0,
                };
                assert!(
                    r.outcomes.len() >= at_least && r.outcomes.len() <= feed,
                    "run {run}: {} outcome lines",
                    r.outcomes.len()
                );
                killed_runs.push((r.outcomes.len(), r.fed));
            }
            None => last = Some(r),
        }
        processed_in.push(processed);
    }

    // (a) Acked before a kill => duplicate in every later run. The claimed-set walk above
    // already fails on a second `processed`; the final, complete run must also have shown
    // every earlier-claimed key as duplicate (it saw every key).
    let last = last.expect("final run");
    assert_eq!(
        last.status.code(),
        Some(0),
        "final run exit; stderr:\n{}",
        last.stderr
    );
    assert!(!last.partial_tail);
    assert_eq!(
        last.outcomes.len(),
        LINES,
        "final run: one outcome per input line"
    );
    assert_eq!(last.fed, LINES);
    let final_run = plan.len() - 1;
    for (i, key) in stream.keys.iter().enumerate() {
        if let Some(&run) = claimed.get(key) {
            if run < final_run {
                assert_eq!(
                    last.outcomes[i],
                    "duplicate",
                    "final run line {}: {} {} was claimed in run {run}",
                    i + 1,
                    SUBSCRIBERS[key.0],
                    id_text(key.1)
                );
            }
        }
    }

    // (b) Exactly once: processed sets are disjoint, and together with the claims whose ack
    // a kill swallowed they cover every unique key.
    let total_processed: usize = processed_in.iter().map(HashSet::len).sum();
    let mut union: HashSet<Key> = HashSet::new();
    for set in &processed_in {
        union.extend(set.iter().copied());
    }
    assert_eq!(
        union.len(),
        total_processed,
        "a key was processed in two runs"
    );
    assert!(union.is_disjoint(&lost_acks));
    let covered: HashSet<Key> = union.union(&lost_acks).copied().collect();
    assert_eq!(
        covered.len(),
        unique.len(),
        "keys never processed: {:?}",
        unique.difference(&covered).take(10).collect::<Vec<_>>()
    );
    assert_eq!(covered, unique);
    assert!(
        processed_in.iter().take(final_run).any(|s| !s.is_empty()),
        "the killed runs acked first deliveries"
    );

    // The store agrees: one claim per unique key, nothing quarantined.
    let claims = claims_per_subscriber(&dir);
    for (sub, name) in SUBSCRIBERS.iter().enumerate() {
        let want = unique.iter().filter(|k| k.0 == sub).count() as u64;
        let (stored, quarantined, sealed) = claims
            .get(*name)
            .copied()
            .unwrap_or_else(|| panic!("inspect lists {name}: {claims:?}"));
        assert_eq!(stored, want, "claims of {name}");
        assert_eq!(quarantined, 0, "quarantined of {name}");
        if expect_sealed {
            assert!(sealed > 0, "{name} has sealed generations");
        }
    }
    eprintln!(
        "seed {seed:#x}: {} unique keys, {} processed with a printed ack, {} acks lost to kills, {:.1}s",
        unique.len(),
        union.len(),
        lost_acks.len(),
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn kill_9_mid_stream_neither_loses_nor_doubles_a_claim() {
    for seed in seeds(0x00DE_DD0C_4A5B_0001) {
        crash_scenario("[ledger]\nshards = 2\n", seed, false);
    }
}

#[test]
fn kill_9_while_sealing_and_merging_neither_loses_nor_doubles_a_claim() {
    // Small generations: every run seals and merges several times, so kills land in the
    // middle of that work too.
    for seed in seeds(0x5EA1_0000_0000_0001) {
        crash_scenario(
            "[ledger]\nshards = 2\ngeneration_max_claims = 1500\nmerge_trigger_generations = 2\nmerge_max_claims = 6000\n",
            seed,
            true,
        );
    }
}
