//! `dedupd-bench compare`: the same deterministic workload against dedupd and the stores
//! people deduplicate with instead (naive redb, PostgreSQL, Redis, SQLite), in one run, so
//! the ratios compare like with like on one machine at one moment.
//!
//! Every system gets the generator's id sequence (same seed, duplicate rate, subscriber)
//! and is checked against it: new ids must be stored, repeated ids refused, and a row whose
//! counts differ is marked unverified (its figures are not a dedup store's). A peer that
//! cannot start (package missing, port refused) is reported as skipped with the reason.
//!
//! Servers are started by the bench from the Debian packages on loopback, in scratch
//! directories next to the engine's, and stopped afterwards. Memory is the server's
//! process tree (proportional set size) after the load minus before; disk is the allocated
//! bytes of its data directory after minus before; both divided by stored keys.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use dedupd::bench::{BenchParams, BenchReport, Progress, SeriesPoint};
use dedupd::config::Config;
use dedupd::source::generator::{Event, Expect, Traffic, TrafficSpec};
use dedupd::telemetry::Latency;

pub(crate) mod plot;
mod postgres;
mod redis;
mod server;
mod sqlite;

/// Parameters of one comparison.
#[derive(Debug, Clone, Serialize)]
pub struct CompareParams {
    /// Messages for the batched systems (dedupd, PostgreSQL batched, Redis pipelined, SQLite).
    pub messages: u64,
    /// Messages for the one-request-per-message systems (PostgreSQL per transaction,
    /// Redis unpipelined): they are one to two orders slower, so they get fewer, and their
    /// rates (not totals) are compared.
    pub request_messages: u64,
    /// Messages for the naive redb baseline (0: skip it).
    pub naive_messages: u64,
    /// Keys the naive baseline's table holds before its measured messages (a store in use
    /// for a while; the target compares at 10M keys).
    pub naive_stored: u64,
    pub dup_rate: f64,
    pub seed: u64,
    /// Messages per statement, pipeline or transaction of the batched peers.
    pub batch: u64,
    /// Connections of the one-request-per-message peers.
    pub clients: u32,
    /// dedupd's in-flight window (as `dedupd bench --window`).
    pub window: u64,
    /// The shipping-label component for the handler rows (skipped when missing).
    pub handler: PathBuf,
    /// Where scratch directories go.
    pub dir: PathBuf,
    /// Released messages between two points of dedupd's throughput series.
    pub series_step: u64,
    #[serde(skip)]
    pub config: Config,
}

/// The generator's traffic as one peer client sees it.
#[derive(Debug, Clone)]
pub(crate) struct Workload {
    pub spec: TrafficSpec,
    pub batch: u64,
    pub clients: u32,
    pub subscriber: String,
    pub dir: PathBuf,
}

impl Workload {
    /// `(id, what it must get)` for every `clients`-th message from `index`: clients split
    /// the one sequence, so together they send exactly the generator's messages.
    pub fn messages(&self, index: u32, clients: u32) -> impl Iterator<Item = (String, Expect)> {
        let mut traffic = Traffic::new(self.spec);
        let mut ev = Event::default();
        let mut seq = 0u64;
        std::iter::from_fn(move || loop {
            if !traffic.next_into(&mut ev) {
                return None;
            }
            seq += 1;
            if (seq - 1) % u64::from(clients.max(1)) == u64::from(index) {
                return Some((ev.id.clone(), ev.expect.unwrap_or(Expect::New)));
            }
        })
    }
}

/// What one peer run measured (per client, then summed).
#[derive(Default)]
pub(crate) struct PeerRun {
    pub elapsed: Duration,
    pub processed: u64,
    /// Messages by what the generator says they must get: new, repeated.
    pub expected: [u64; 2],
    /// Per request (one message) or per batch.
    pub latency: Latency,
    pub stored_keys: u64,
    /// Keys the store held before the measured messages (counted in `stored_keys`).
    pub preloaded_keys: u64,
    pub memory_bytes: u64,
    /// Redis's own count (`used_memory`), beside the process's.
    pub used_memory_bytes: Option<u64>,
    pub disk_bytes: u64,
}

impl PeerRun {
    pub fn expect(&mut self, e: Expect) {
        self.expected[usize::from(e != Expect::New)] += 1;
    }

    pub fn add(&mut self, other: PeerRun) {
        self.processed += other.processed;
        self.expected[0] += other.expected[0];
        self.expected[1] += other.expected[1];
        self.latency.merge(&other.latency);
    }
}

/// How a peer row is run (deferred, so rows run one at a time, in order).
type PeerFn<'a> = Box<dyn Fn() -> Result<PeerRun, String> + 'a>;

/// One system's row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct SystemRow {
    /// Stable name for scripts: `dedupd_claim`, `postgres_batch`, `redis_always`, ...
    pub key: String,
    pub system: String,
    /// What an acknowledged message survives, in words.
    pub durability: String,
    /// Why the row was not measured; `None` when it was.
    pub skipped: Option<String>,
    pub messages: u64,
    pub processed: u64,
    pub duplicates: u64,
    /// Distinct ids the traffic held, and duplicates it held.
    pub expected_processed: u64,
    pub expected_duplicates: u64,
    /// Keys the store holds at the end (its own count).
    pub stored_keys: u64,
    /// processed = expected, duplicates = expected, stored keys = distinct ids.
    pub verified: bool,
    pub msgs_per_sec: f64,
    /// What a latency sample is: `message ack`, `request`, `batch of N`.
    pub latency_of: String,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub memory_bytes_per_key: f64,
    /// Redis only: `used_memory` per key (the allocator's view, without fragmentation).
    pub used_memory_bytes_per_key: Option<f64>,
    pub disk_bytes_per_key: f64,
    /// dedupd claim-only msgs/s over this row's, from the same run.
    pub dedupd_ratio: f64,
}

impl SystemRow {
    fn skipped(key: &str, system: &str, durability: &str, reason: String) -> SystemRow {
        SystemRow {
            key: key.into(),
            system: system.into(),
            durability: durability.into(),
            skipped: Some(reason),
            messages: 0,
            processed: 0,
            duplicates: 0,
            expected_processed: 0,
            expected_duplicates: 0,
            stored_keys: 0,
            verified: false,
            msgs_per_sec: 0.0,
            latency_of: String::new(),
            p50_ms: 0.0,
            p99_ms: 0.0,
            memory_bytes_per_key: 0.0,
            used_memory_bytes_per_key: None,
            disk_bytes_per_key: 0.0,
            dedupd_ratio: f64::NAN,
        }
    }

    fn from_peer(
        key: &str,
        system: &str,
        durability: &str,
        latency_of: String,
        r: &PeerRun,
    ) -> SystemRow {
        let messages = r.expected[0] + r.expected[1];
        let keys = r.stored_keys.max(1) as f64;
        SystemRow {
            key: key.into(),
            system: system.into(),
            durability: durability.into(),
            skipped: None,
            messages,
            processed: r.processed,
            duplicates: messages - r.processed.min(messages),
            expected_processed: r.expected[0],
            expected_duplicates: r.expected[1],
            stored_keys: r.stored_keys,
            verified: r.processed == r.expected[0]
                && r.stored_keys == r.expected[0] + r.preloaded_keys,
            msgs_per_sec: messages as f64 / r.elapsed.as_secs_f64().max(1e-9),
            latency_of,
            p50_ms: r.latency.quantile_ms(0.5),
            p99_ms: r.latency.quantile_ms(0.99),
            memory_bytes_per_key: r.memory_bytes as f64 / keys,
            used_memory_bytes_per_key: r.used_memory_bytes.map(|b| b as f64 / keys),
            disk_bytes_per_key: r.disk_bytes as f64 / keys,
            dedupd_ratio: f64::NAN,
        }
    }

    fn from_engine(key: &str, system: &str, r: &BenchReport) -> SystemRow {
        SystemRow {
            key: key.into(),
            system: system.into(),
            durability: "fsync per batch (redb durable commit before the ack)".into(),
            skipped: None,
            messages: r.params.messages,
            processed: r.processed,
            duplicates: r.duplicates,
            expected_processed: r.processed,
            expected_duplicates: r.duplicates,
            stored_keys: r.stored_keys,
            // The engine checks each outcome against the generator (`verified`).
            verified: r.verified && r.stored_keys == r.processed && r.quarantined == 0,
            msgs_per_sec: r.msgs_per_sec,
            latency_of: "message ack".into(),
            p50_ms: r.p50_ack_ms,
            p99_ms: r.p99_ack_ms,
            memory_bytes_per_key: r.rss_bytes_per_key,
            used_memory_bytes_per_key: None,
            disk_bytes_per_key: r.disk_allocated_bytes_per_key,
            dedupd_ratio: f64::NAN,
        }
    }

    pub fn measured(&self) -> bool {
        self.skipped.is_none()
    }
}

/// A target of issue 18: dedupd's ratio to a peer, and the goal.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub what: String,
    /// `None` when either row was skipped.
    pub ratio: Option<f64>,
    pub goal: f64,
    pub met: Option<bool>,
}

/// Where and when the run happened.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub date_utc: String,
    pub commit: String,
    pub cores: usize,
    pub cpu: String,
    pub ram_bytes: u64,
    pub disk: String,
    /// 1, 5 and 15 minute load averages at the start and at the end.
    pub load_start: String,
    pub load_end: String,
}

/// Everything a comparison measured.
#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    pub params: CompareParams,
    pub machine: Machine,
    pub rows: Vec<SystemRow>,
    pub targets: Vec<Target>,
    /// dedupd claim-only throughput as its stored claims grew.
    pub series: Vec<SeriesPoint>,
    /// PNG files written (empty without `--plots`).
    pub plots: Vec<PathBuf>,
}

impl CompareReport {
    /// Every measured row matched its traffic.
    pub fn verified(&self) -> bool {
        self.rows
            .iter()
            .filter(|r| r.measured())
            .all(|r| r.verified)
    }
}

/// Runs every system in turn (one at a time, so they do not share the machine), then
/// computes the ratios and, with `plots`, draws them.
pub fn run_compare(
    params: &CompareParams,
    plots: Option<&std::path::Path>,
    mut log: impl FnMut(&str),
    mut progress: impl FnMut(Progress),
) -> CompareReport {
    let load_start = load_average();
    let spec = |messages| TrafficSpec {
        seed: params.seed,
        messages,
        dup_rate: params.dup_rate,
        mismatch_rate: 0.0,
        subscribers: 1,
        random_order_ids: false,
        orders: None,
    };
    let mut rows = Vec::new();
    let mut series = Vec::new();

    let engine = |handler: Option<PathBuf>, random: bool| BenchParams {
        messages: params.messages,
        dup_rate: params.dup_rate,
        mismatch_rate: 0.0,
        subscribers: 1,
        seed: params.seed,
        window: params.window,
        naive_messages: 0,
        dir: params.dir.clone(),
        keep: false,
        handler,
        partition_pointer: Some("/order_id".into()),
        random_order_ids: random,
        orders: None,
        series_step: params.series_step,
        rate: None,
        config: params.config.clone(),
    };
    let handler_rows = [
        (None, false, "dedupd_claim", "dedupd claim-only"),
        (
            Some(params.handler.clone()),
            false,
            "dedupd_label_seq",
            "dedupd + shipping-label (sequential order ids)",
        ),
        (
            Some(params.handler.clone()),
            true,
            "dedupd_label_random",
            "dedupd + shipping-label (random order ids)",
        ),
    ];
    for (handler, random, key, system) in handler_rows {
        log(system);
        if let Some(h) = handler.as_ref().filter(|h| !h.exists()) {
            let reason = format!(
                "{} not found: build the plugins first (plugins/build.sh)",
                h.display()
            );
            rows.push(SystemRow::skipped(key, system, "fsync per batch", reason));
            continue;
        }
        match dedupd::bench::run(&engine(handler, random), &mut progress) {
            Ok(r) => {
                if key == "dedupd_claim" {
                    series = r.series.clone();
                }
                rows.push(SystemRow::from_engine(key, system, &r));
            }
            Err(e) => rows.push(SystemRow::skipped(
                key,
                system,
                "fsync per batch",
                e.to_string(),
            )),
        }
    }

    let naive = if params.naive_stored > 0 {
        format!(
            "naive redb (one table, get-then-insert; {} keys stored first)",
            params.naive_stored
        )
    } else {
        "naive redb (one table, get-then-insert)".to_string()
    };
    let naive = naive.as_str();
    log(naive);
    rows.push(run_naive_row(
        params,
        spec(params.naive_messages),
        naive,
        &mut progress,
    ));

    let workload = |messages| Workload {
        spec: spec(messages),
        batch: params.batch.max(1),
        clients: params.clients.max(1),
        subscriber: "bench-0".into(),
        dir: params.dir.clone(),
    };
    let (batched, single) = (workload(params.messages), workload(params.request_messages));
    let batch_of = format!("batch of {}", params.batch);
    let clients = params.clients.max(1);
    let peers: Vec<(&str, String, &str, String, PeerFn<'_>)> = vec![
        (
            "postgres_txn",
            format!("PostgreSQL 1 msg/txn, {clients} clients"),
            "fsync per transaction (synchronous_commit=on, group commit)",
            "request".into(),
            Box::new(|| postgres::run(&single, postgres::Mode::PerTransaction)),
        ),
        (
            "postgres_batch",
            format!("PostgreSQL {} msgs/statement", params.batch),
            "fsync per batch (synchronous_commit=on)",
            batch_of.clone(),
            Box::new(|| postgres::run(&batched, postgres::Mode::Batched)),
        ),
        (
            "redis_everysec",
            format!("Redis SET NX EX, {clients} clients, AOF everysec"),
            "AOF everysec: up to 1 s of acked messages lost on a crash",
            "request".into(),
            Box::new(|| redis::run(&single, "everysec", false)),
        ),
        (
            "redis_everysec_pipelined",
            format!("Redis SET NX EX pipelined ({}), AOF everysec", params.batch),
            "AOF everysec: up to 1 s of acked messages lost on a crash",
            batch_of.clone(),
            Box::new(|| redis::run(&batched, "everysec", true)),
        ),
        (
            "redis_always",
            format!("Redis SET NX EX, {clients} clients, AOF always"),
            "AOF always: fsync before the reply",
            "request".into(),
            Box::new(|| redis::run(&single, "always", false)),
        ),
        (
            "redis_always_pipelined",
            format!("Redis SET NX EX pipelined ({}), AOF always", params.batch),
            "AOF always: fsync before the replies",
            batch_of.clone(),
            Box::new(|| redis::run(&batched, "always", true)),
        ),
        (
            "sqlite_batch",
            format!("SQLite WAL INSERT OR IGNORE, {} msgs/txn", params.batch),
            "fsync per batch (WAL, synchronous=FULL)",
            batch_of.clone(),
            Box::new(|| sqlite::run(&batched)),
        ),
    ];
    for (key, system, durability, latency_of, f) in peers {
        log(&system);
        rows.push(match f() {
            Ok(r) => SystemRow::from_peer(key, &system, durability, latency_of, &r),
            Err(reason) => SystemRow::skipped(key, &system, durability, reason),
        });
    }

    let base = rows
        .iter()
        .find(|r| r.key == "dedupd_claim" && r.measured())
        .map(|r| r.msgs_per_sec);
    for r in rows.iter_mut().filter(|r| r.measured()) {
        r.dedupd_ratio = base.map_or(f64::NAN, |b| b / r.msgs_per_sec.max(1e-9));
    }
    let targets = targets(&rows);
    let mut report = CompareReport {
        params: params.clone(),
        machine: machine(&params.dir, load_start),
        rows,
        targets,
        series,
        plots: Vec::new(),
    };
    if let Some(dir) = plots {
        match plot::draw_all(&report, dir) {
            Ok(files) => report.plots = files,
            Err(e) => log(&format!("plots not written: {e}")),
        }
    }
    report
}

fn run_naive_row(
    params: &CompareParams,
    spec: TrafficSpec,
    system: &str,
    progress: &mut impl FnMut(Progress),
) -> SystemRow {
    let (key, durability) = ("naive_redb", "fsync per batch (redb durable commit)");
    if params.naive_messages == 0 {
        return SystemRow::skipped(key, system, durability, "--naive-messages 0".into());
    }
    let scratch = match tempfile::Builder::new()
        .prefix(".dedupd-compare-naive-")
        .tempdir_in(&params.dir)
    {
        Ok(t) => t,
        Err(e) => return SystemRow::skipped(key, system, durability, e.to_string()),
    };
    let path = scratch.path().join("naive.redb");
    let cache_mib = params.config.ledger.cache_mib.get()
        * params.config.ledger.shards.map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |n| n.get(),
        );
    let rss_base = dedupd::telemetry::rss_bytes();
    let started = std::time::Instant::now();
    match dedupd::bench::run_naive(
        &path,
        spec,
        params.batch.max(1),
        cache_mib,
        params.naive_stored,
        progress,
    ) {
        Ok(n) => {
            let elapsed = started.elapsed();
            let r = PeerRun {
                elapsed,
                processed: n.processed,
                expected: n.expected,
                stored_keys: n.stored_keys,
                preloaded_keys: params.naive_stored,
                memory_bytes: dedupd::telemetry::rss_bytes().saturating_sub(rss_base),
                disk_bytes: server::tree_allocated_bytes(scratch.path()),
                ..PeerRun::default()
            };
            let mut row = SystemRow::from_peer(
                key,
                system,
                durability,
                format!("batch of {}", params.batch),
                &r,
            );
            // The baseline times itself (without the file's creation).
            row.msgs_per_sec = n.msgs_per_sec;
            row.p50_ms = n.p50_batch_ms;
            row.p99_ms = n.p99_batch_ms;
            row
        }
        Err(e) => SystemRow::skipped(key, system, durability, e.to_string()),
    }
}

fn targets(rows: &[SystemRow]) -> Vec<Target> {
    let rate = |k: &str| {
        rows.iter()
            .find(|r| r.key == k && r.measured())
            .map(|r| r.msgs_per_sec)
    };
    let t = |what: &str, a: &str, b: &str, goal: f64| {
        let ratio = rate(a).zip(rate(b)).map(|(a, b)| a / b.max(1e-9));
        Target {
            what: what.into(),
            ratio,
            goal,
            met: ratio.map(|r| r >= goal),
        }
    };
    vec![
        t(
            "dedupd claim-only / Redis pipelined (AOF everysec)",
            "dedupd_claim",
            "redis_everysec_pipelined",
            3.0,
        ),
        t(
            "dedupd claim-only / PostgreSQL batched",
            "dedupd_claim",
            "postgres_batch",
            5.0,
        ),
        t(
            "dedupd claim-only / naive redb",
            "dedupd_claim",
            "naive_redb",
            20.0,
        ),
        t(
            "dedupd + shipping-label (random ids) / PostgreSQL batched",
            "dedupd_label_random",
            "postgres_batch",
            1.0,
        ),
    ]
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn machine(dir: &std::path::Path, load_start: String) -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let ram_bytes = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024;
    let disk = std::process::Command::new("df")
        .args(["-h", "--output=source,fstype,size"])
        .arg(dir)
        .output()
        .ok()
        .and_then(|o| {
            let text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.lines()
                .nth(1)
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_default();
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    Machine {
        date_utc: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        commit,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu,
        ram_bytes,
        disk,
        load_start,
        load_end: load_average(),
    }
}

impl std::fmt::Display for CompareReport {
    /// The table (Markdown, so the README can carry it as printed).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = &self.machine;
        writeln!(
            f,
            "{} · commit {} · {} cores ({}) · {:.1} GiB RAM · disk {} · load {} → {}",
            m.date_utc,
            m.commit,
            m.cores,
            m.cpu,
            m.ram_bytes as f64 / (1u64 << 30) as f64,
            m.disk,
            m.load_start,
            m.load_end
        )?;
        writeln!(f)?;
        writeln!(f, "| system | durability | msgs | msgs/s | p50 / p99 ms (per) | memory B/key | disk B/key | dedupd × | verified |")?;
        writeln!(f, "|---|---|---:|---:|---|---:|---:|---:|---|")?;
        for r in &self.rows {
            match &r.skipped {
                Some(reason) => writeln!(
                    f,
                    "| {} | {} | – | skipped | {} | | | | |",
                    r.system,
                    r.durability,
                    reason.replace('|', "/").replace('\n', " ")
                )?,
                None => writeln!(
                    f,
                    "| {} | {} | {} | {:.0} | {:.2} / {:.2} ({}) | {:.0}{} | {:.0} | {:.1} | {} |",
                    r.system,
                    r.durability,
                    r.messages,
                    r.msgs_per_sec,
                    r.p50_ms,
                    r.p99_ms,
                    r.latency_of,
                    r.memory_bytes_per_key,
                    r.used_memory_bytes_per_key
                        .map(|u| format!(" (used_memory {u:.0})"))
                        .unwrap_or_default(),
                    r.disk_bytes_per_key,
                    r.dedupd_ratio,
                    if r.verified { "yes" } else { "NO" }
                )?,
            }
        }
        writeln!(f)?;
        for t in &self.targets {
            match (t.ratio, t.met) {
                (Some(r), Some(met)) => writeln!(
                    f,
                    "- {}: {:.1}x (target ≥ {}x: {})",
                    t.what,
                    r,
                    t.goal,
                    if met { "met" } else { "NOT met" }
                )?,
                _ => writeln!(f, "- {}: not measured (a row was skipped)", t.what)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_that_stores_every_message_fails_its_row() {
        let honest = PeerRun {
            elapsed: Duration::from_secs(1),
            processed: 90,
            expected: [90, 10],
            stored_keys: 90,
            ..PeerRun::default()
        };
        let row = SystemRow::from_peer("p", "peer", "none", "request".into(), &honest);
        assert!(row.verified);
        assert_eq!((row.processed, row.duplicates, row.messages), (90, 10, 100));
        let no_dedup = PeerRun {
            processed: 100,
            stored_keys: 100,
            ..honest
        };
        let row = SystemRow::from_peer("p", "peer", "none", "request".into(), &no_dedup);
        assert!(!row.verified);
        let lost = PeerRun {
            stored_keys: 80,
            ..no_dedup
        };
        assert!(!SystemRow::from_peer("p", "peer", "none", "request".into(), &lost).verified);
    }

    #[test]
    fn clients_split_the_one_sequence_exactly() {
        let w = Workload {
            spec: TrafficSpec {
                seed: 3,
                messages: 1_000,
                dup_rate: 0.2,
                mismatch_rate: 0.0,
                subscribers: 1,
                random_order_ids: false,
                orders: None,
            },
            batch: 10,
            clients: 3,
            subscriber: "s".into(),
            dir: PathBuf::from("."),
        };
        let all: Vec<_> = w.messages(0, 1).map(|(id, _)| id).collect();
        let mut split: Vec<_> = (0..3)
            .flat_map(|i| w.messages(i, 3).map(|(id, _)| id))
            .collect();
        let mut sorted = all.clone();
        split.sort();
        sorted.sort();
        assert_eq!(all.len(), 1_000);
        assert_eq!(split, sorted);
    }
}
