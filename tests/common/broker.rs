//! What the broker tests (`tests/nats.rs`, `tests/mqtt.rs`, `tests/rabbitmq.rs`) share
//! around their servers: waiting, free ports, `GET` of `/readyz` and `/metrics`, a source
//! run in the test's process until a condition holds or with its stop timed, `dedupd run` as a child (started,
//! killed in kill -9 rounds, stopped gracefully), the counts of the `fixture-counter`
//! handler, and `config check` of a section.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::Ledger;
use dedupd::pipeline::{Cause, Shutdown};

use super::Run;

/// A loopback TCP port nobody listens on (bound and released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A runtime on the test's thread for a broker client.
pub fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Asks `f` every 50 ms until it holds; panics after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, f: impl FnMut() -> bool) {
    wait_logged(what, timeout, None, f);
}

/// [`wait_until`]; a timeout shows the end of `log` (a `dedupd run`'s).
pub fn wait_logged(what: &str, timeout: Duration, log: Option<&Path>, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        if start.elapsed() >= timeout {
            let text = log
                .map(|l| std::fs::read_to_string(l).unwrap_or_default())
                .unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!("timed out waiting for {what}; log:\n{}", tail.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `GET path` on `addr`: the status code and the body (0 when nothing listens).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return (0, String::new());
    };
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// The claims of every subscriber of `ledger`.
pub fn claims(ledger: &Ledger) -> u64 {
    ledger
        .report()
        .unwrap()
        .subscribers
        .iter()
        .map(|s| s.claims)
        .sum()
}

/// The lines that make a subscriber `orders` run a handler, keyed into entities by
/// `/order_id`, with `budget` of CPU per call (nothing without a handler).
pub fn handler_lines(handler: Option<&Path>, budget: &str) -> String {
    handler
        .map(|h| {
            format!(
                "partition_key = {{ source = \"json_pointer\", pointer = \"/order_id\" }}\nhandler = {:?}\nhandler_cpu_budget = \"{budget}\"\n",
                h.display().to_string()
            )
        })
        .unwrap_or_default()
}

/// Opens the ledger in `data` with `config`'s handlers and runs a source (`run`) in this
/// process until `done` holds (asked from 300 ms on, with the ledger; at most `timeout`),
/// then stops it. The source must not have failed; returns its summary and the ledger.
pub fn run_source_until<S, E>(
    config: &Config,
    data: &Path,
    timeout: Duration,
    run: impl FnOnce(Arc<Ledger>, &Shutdown) -> Result<S, E> + Send,
    done: impl Fn(&Ledger) -> bool,
) -> (S, Ledger)
where
    S: Send + std::fmt::Debug,
    E: Send + std::fmt::Debug,
{
    let ledger = Arc::new(Ledger::open(data, config, Arc::new(SystemClock)).unwrap());
    dedupd::pipeline::install_handlers(&ledger, config).unwrap();
    let shutdown = Shutdown::new();
    let summary = std::thread::scope(|scope| {
        let runner = {
            let (ledger, shutdown) = (ledger.clone(), shutdown.clone());
            scope.spawn(move || run(ledger, &shutdown))
        };
        // The consumer exists once the source started; then the condition is asked.
        std::thread::sleep(Duration::from_millis(300));
        wait_until("the stop condition", timeout, || {
            shutdown.is_triggered() || done(&ledger)
        });
        shutdown.trigger(Cause::Requested);
        runner.join().unwrap()
    });
    assert_eq!(
        shutdown.cause(),
        Some(Cause::Requested),
        "the source failed: {summary:?}"
    );
    let summary = summary.unwrap();
    let ledger = Arc::try_unwrap(ledger).ok().unwrap();
    (summary, ledger)
}

/// A source running in the test's process on a thread of its own (not a scoped one: a
/// stop that never returns must fail the test, not hold it), for tests that time its stop.
pub struct Running<S> {
    pub ledger: Arc<Ledger>,
    shutdown: Shutdown,
    ended: std::sync::mpsc::Receiver<S>,
}

/// Opens the ledger in `data` with `config`'s handlers and starts `run` on it.
pub fn start_source<S: Send + 'static>(
    config: &Config,
    data: &Path,
    run: impl FnOnce(Arc<Ledger>, &Shutdown) -> S + Send + 'static,
) -> Running<S> {
    let ledger = Arc::new(Ledger::open(data, config, Arc::new(SystemClock)).unwrap());
    dedupd::pipeline::install_handlers(&ledger, config).unwrap();
    let (shutdown, (tx, ended)) = (Shutdown::new(), std::sync::mpsc::channel());
    let (l, s) = (ledger.clone(), shutdown.clone());
    std::thread::spawn(move || {
        let _ = tx.send(run(l, &s));
    });
    Running {
        ledger,
        shutdown,
        ended,
    }
}

impl<S> Running<S> {
    /// Stops the source: what it returned and how long the stop took; fails the test if it
    /// has not returned within `wait`.
    pub fn stop_timed(self, wait: Duration) -> (S, Duration) {
        let stopping = Instant::now();
        self.shutdown.trigger(Cause::Requested);
        let ended = self.ended.recv_timeout(wait);
        let took = stopping.elapsed();
        let ended =
            ended.unwrap_or_else(|_| panic!("the stop still waits for the server after {took:?}"));
        (ended, took)
    }
}

/// Kills a child process when dropped.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `dedupd run --config CFG --data-dir DATA`, engine logs at info into `log`, the summary
/// on a pipe.
pub fn dedupd_run(cfg: &Path, data: &Path, log: &Path) -> KillOnDrop {
    KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_dedupd"))
            .args(["run", "--config"])
            .arg(cfg)
            .arg("--data-dir")
            .arg(data)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "dedupd=info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    )
}

/// SIGTERM, then the run's summary line (`{"nats": {...}}`); asserts a clean exit.
pub fn stop_gracefully(mut child: KillOnDrop, log: &Path) -> serde_json::Value {
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut printed = String::new();
    std::io::Read::read_to_string(child.0.stdout.as_mut().unwrap(), &mut printed).unwrap();
    let exit = child.0.wait().unwrap();
    assert!(
        exit.success(),
        "graceful stop exits 0, got {exit:?}: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    serde_json::from_str(printed.trim()).unwrap()
}

/// What `dedupd run` showed of a broker it cannot reach over TLS ([`refused_over_tls`]).
pub struct Refused {
    /// The body of `/readyz` once it said 503 naming a certificate.
    pub readyz: String,
    /// The run's log.
    pub log: String,
    /// The summary line it printed when stopped.
    pub summary: serde_json::Value,
}

/// `dedupd run` of the config `text` (a source section, no `[metrics]`) in `dir/<case>`,
/// until `/readyz` answers 503 with a reason that names a certificate (30 s at most); then
/// a graceful stop. The TLS tests of each broker check the reason, the log and the summary.
pub fn refused_over_tls(dir: &Path, case: &str, text: &str) -> Refused {
    let run = dir.join(case.replace(' ', "-"));
    std::fs::create_dir_all(&run).unwrap();
    let cfg = run.join("dedupd.toml");
    let metrics = format!("127.0.0.1:{}", free_port());
    std::fs::write(&cfg, format!("{text}\n[metrics]\nbind = \"{metrics}\"\n")).unwrap();
    let log = run.join("run.log");
    let child = dedupd_run(&cfg, &run.join("data"), &log);
    let mut readyz = String::new();
    wait_logged(
        &format!("{case}: readyz 503 naming a certificate"),
        Duration::from_secs(30),
        Some(&log),
        || {
            let (status, body) = http_get(&metrics, "/readyz");
            readyz = body;
            status == 503 && readyz.to_lowercase().contains("certificate")
        },
    );
    eprintln!("{case}: {readyz}");
    let logged = std::fs::read_to_string(&log).unwrap();
    let summary = stop_gracefully(child, &log);
    Refused {
        readyz,
        log: logged,
        summary,
    }
}

/// Whether a line of `log` contains `marker` and names a certificate.
pub fn logged_with_certificate(log: &str, marker: &str) -> bool {
    log.lines()
        .any(|l| l.contains(marker) && l.to_lowercase().contains("certificate"))
}

/// The last value of ` field=` in the lines of `log` that contain `marker` (a progress
/// line's counter, `acked`).
pub fn last_logged(log: &Path, marker: &str, field: &str) -> Option<u64> {
    let needle = format!(" {field}=");
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(marker))
        .filter_map(|l| l.split(&needle).nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .next_back()
}

pub fn mix_u64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 31)
}

/// Events `0..events` as `msgs` makes them (one event per range), each tenth followed by
/// an earlier event published again (`n - 7`), cut into `rounds + 1` parts.
pub fn events_with_repeats<M>(
    events: usize,
    rounds: usize,
    msgs: impl Fn(std::ops::Range<usize>) -> Vec<M>,
) -> Vec<Vec<M>> {
    let mut all = Vec::new();
    for n in 0..events {
        all.extend(msgs(n..n + 1));
        if n % 10 == 9 {
            all.extend(msgs(n - 7..n - 6)); // an earlier event published again
        }
    }
    let size = all.len().div_ceil(rounds + 1);
    let mut parts = Vec::new();
    let mut it = all.into_iter().peekable();
    while it.peek().is_some() {
        parts.push(it.by_ref().take(size).collect::<Vec<M>>());
    }
    assert_eq!(parts.len(), rounds + 1);
    parts
}

/// Kill -9 rounds of `dedupd run` with config `cfg` on `data`, its log in `log`.
pub struct KillRounds<'a> {
    pub cfg: &'a Path,
    pub data: &'a Path,
    pub log: &'a Path,
    /// The log line of a run whose source consumes (`nats consumer started`).
    pub started: &'a str,
    pub seed: u64,
}

impl KillRounds<'_> {
    /// `dedupd run`, once its log says `started`.
    pub fn start(&self) -> KillOnDrop {
        let child = dedupd_run(self.cfg, self.data, self.log);
        wait_logged(
            &format!("{:?} in the log", self.started),
            Duration::from_secs(60),
            Some(self.log),
            || std::fs::read_to_string(self.log).is_ok_and(|l| l.contains(self.started)),
        );
        child
    }

    /// One round per part but the last (left to the caller): publishes the part, starts
    /// dedupd and kills it with SIGKILL after a seeded pause (`seed` mixed with the
    /// round), in every odd round only once `acked` (read from the log) says some
    /// acknowledgements were sent. Returns what `acked` said at each kill.
    pub fn run<M>(
        &self,
        parts: &[Vec<M>],
        mut publish: impl FnMut(&[M]),
        acked: impl Fn(&Path) -> u64,
    ) -> Vec<u64> {
        let mut acked_at_kills = Vec::new();
        for (round, part) in parts[..parts.len() - 1].iter().enumerate() {
            publish(part);
            let child = self.start();
            let r = mix_u64((round as u64) ^ super::seed(self.seed));
            if round % 2 == 1 {
                wait_logged(
                    "acknowledgements",
                    Duration::from_secs(60),
                    Some(self.log),
                    || acked(self.log) > 0,
                );
                std::thread::sleep(Duration::from_millis(r % 150));
            } else {
                std::thread::sleep(Duration::from_millis(r % 400));
            }
            drop(child); // SIGKILL
            acked_at_kills.push(acked(self.log));
        }
        acked_at_kills
    }
}

/// One claim per distinct event and every `fixture-counter` order (two events) at 2.
pub fn assert_counts_exact(data: &Path, config: &Config, events: usize) {
    let ledger = Ledger::open(data, config, Arc::new(SystemClock)).unwrap();
    let counts: Vec<(Vec<u8>, Vec<u8>)> = ledger.state_entries("orders").unwrap();
    let claims = claims(&ledger);
    ledger.close().unwrap();
    assert_eq!(claims, events as u64, "one claim per distinct event");
    assert_eq!(counts.len(), events / 2, "orders lost or split");
    let wrong: Vec<_> = counts
        .iter()
        .filter(|(_, v)| v.as_slice() != b"2")
        .take(5)
        .map(|(k, v)| {
            (
                String::from_utf8_lossy(k).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            )
        })
        .collect();
    assert!(wrong.is_empty(), "counts doubled or lost: {wrong:?}");
}

/// Every metric of `names` is on the `/metrics` page `text` for the subscriber `orders`.
pub fn assert_metrics_of_orders(text: &str, names: &[&str]) {
    for name in names {
        assert!(
            text.lines()
                .any(|l| l.starts_with(name) && l.contains("subscriber=\"orders\"")),
            "{name} missing:\n{text}"
        );
    }
}

/// `dedupd config check` of `text`, written into `dir`.
pub fn config_check(dir: &Path, text: &str) -> Run {
    let path = dir.join("dedupd.toml");
    std::fs::write(&path, text).unwrap();
    super::dedupd(&["config", "check", path.to_str().unwrap()])
}
