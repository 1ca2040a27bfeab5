//! What the broker benches (`mqtt-bench`, `nats-bench`, `rabbitmq-bench`) share: the
//! generated traffic, a fresh ledger for an engine phase, and the timing of a source from
//! its first message to its last acknowledgement.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::SystemClock;
use crate::config::Config;
use crate::ledger::Ledger;
use crate::pipeline::{Cause, Shutdown};
use crate::source::generator::{Traffic, TrafficSpec};

/// The OrderPlaced events every phase is given: fixed `seed`, `dup_rate` of them
/// redeliveries of an earlier event, one subscriber.
pub(crate) fn traffic(seed: u64, messages: u64, dup_rate: f64) -> Traffic {
    Traffic::new(TrafficSpec {
        seed,
        messages,
        dup_rate,
        mismatch_rate: 0.0,
        subscribers: 1,
        random_order_ids: false,
        orders: None,
    })
}

/// Why [`fresh_ledger`] failed: the data directory or ledger (`Ledger`), or the handler
/// (`Config`), as each source's error type names them.
#[derive(Debug)]
pub(crate) enum SetupError {
    Ledger(String),
    Config(String),
}

/// A ledger on a fresh data directory under `dir` (named `prefix…`, removed with the
/// returned guard), with `config`'s handlers installed.
pub(crate) fn fresh_ledger(
    dir: &Path,
    prefix: &str,
    config: &Config,
) -> Result<(tempfile::TempDir, Arc<Ledger>), SetupError> {
    let data = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(dir)
        .map_err(|e| {
            SetupError::Ledger(format!(
                "cannot create a data directory in {}: {e}",
                dir.display()
            ))
        })?;
    let ledger = Arc::new(
        Ledger::open(data.path(), config, Arc::new(SystemClock))
            .map_err(|e| SetupError::Ledger(e.to_string()))?,
    );
    crate::pipeline::install_handlers(&ledger, config)
        .map_err(|e| SetupError::Config(format!("cannot load the handler: {e}")))?;
    Ok((data, ledger))
}

/// Closes `ledger` when this was its last holder.
pub(crate) fn close_ledger(ledger: Arc<Ledger>) -> Result<(), crate::ledger::LedgerError> {
    match Arc::try_unwrap(ledger) {
        Ok(l) => l.close(),
        Err(_) => Ok(()),
    }
}

/// Runs `source` on a thread of its own until `acked` reaches `count` (timed by
/// [`time_until_acked`]), then stops it and waits for it. Returns that time and what the
/// source returned (`Err` when its thread panicked).
pub(crate) fn run_timed<S: Send, E: Send>(
    source: impl FnOnce(&Shutdown) -> Result<S, E> + Send,
    received: &AtomicU64,
    acked: &AtomicU64,
    count: u64,
    progress: impl FnMut(u64),
) -> (Duration, std::thread::Result<Result<S, E>>) {
    let shutdown = Shutdown::new();
    std::thread::scope(|scope| {
        let runner = {
            let shutdown = shutdown.clone();
            scope.spawn(move || source(&shutdown))
        };
        let elapsed = time_until_acked(received, acked, count, &shutdown, progress);
        shutdown.trigger(Cause::Requested);
        (elapsed, runner.join())
    })
}

/// Waits until `acked` reaches `count` or `shutdown` triggers, looking every 200 µs and
/// telling `progress` the acks every 200 ms; returns the time from the first message
/// `received` to then (zero when none arrived).
pub(crate) fn time_until_acked(
    received: &AtomicU64,
    acked: &AtomicU64,
    count: u64,
    shutdown: &Shutdown,
    mut progress: impl FnMut(u64),
) -> Duration {
    let mut start = None;
    let mut last_progress = Instant::now();
    while acked.load(Ordering::Relaxed) < count && !shutdown.is_triggered() {
        if start.is_none() && received.load(Ordering::Relaxed) > 0 {
            start = Some(Instant::now());
        }
        if last_progress.elapsed() > Duration::from_millis(200) {
            last_progress = Instant::now();
            progress(acked.load(Ordering::Relaxed));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    start.map_or(Duration::ZERO, |t| t.elapsed())
}

/// The consume-only, engine and engine-with-handler rates of a report, one line each
/// (the ratios are to consume-only).
pub(crate) fn write_rates(
    f: &mut std::fmt::Formatter<'_>,
    consume_only: f64,
    engine: (f64, f64),
    handler: Option<(f64, f64)>,
) -> std::fmt::Result {
    writeln!(f, "consume-only          {consume_only:>10.0} msgs/s")?;
    let (rate, ratio) = engine;
    writeln!(
        f,
        "engine, no handler    {rate:>10.0} msgs/s  {ratio:.2}x consume-only"
    )?;
    if let Some((rate, ratio)) = handler {
        writeln!(
            f,
            "engine, handler       {rate:>10.0} msgs/s  {ratio:.2}x consume-only"
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use crate::source::{kafka, mqtt, nats, rabbitmq};

    /// Each broker bench's `run` refuses what it cannot use before it starts a broker,
    /// connects or creates a directory (the addresses here lead nowhere), and says which
    /// parameter and which flag.
    #[test]
    fn every_broker_bench_refuses_bad_parameters_before_it_starts() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let kafka = kafka::bench::KafkaBenchParams {
            messages: 10,
            dup_rate: 0.1,
            seed: 1,
            partitions: 1,
            live_messages: 0,
            handler: Some(PathBuf::from("nowhere.wasm")),
            shards: None,
            dir: dir.clone(),
            brokers: None,
            changelog: false,
            ttl: None,
        };
        let e = kafka::bench::run(&kafka, &mut |_| {}).unwrap_err();
        assert_eq!(
            e.to_string(),
            "handler nowhere.wasm not found: build the plugins first (plugins/build.sh)"
        );
        let mqtt = mqtt::bench::MqttBenchParams {
            broker: "mqtt://127.0.0.1:9".into(),
            messages: 10,
            dup_rate: 1.0,
            seed: 1,
            window: 10,
            round: 10,
            handler: None,
            dir: dir.clone(),
        };
        let e = mqtt::bench::run(&mqtt, &mut |_| {}).unwrap_err();
        assert_eq!(
            e.to_string(),
            "dup_rate (--dup-rate) must be in [0, 1), got 1"
        );
        let nats = nats::bench::NatsBenchParams {
            server: "nats://127.0.0.1:9".into(),
            messages: 10,
            dup_rate: 0.1,
            seed: 1,
            window: 8,
            batch: 16,
            handler: None,
            dir: dir.clone(),
        };
        let e = nats::bench::run(&nats, &mut |_, _, _| {}).unwrap_err();
        assert_eq!(
            e.to_string(),
            "batch (--batch) must be at most the window, got 16 with window 8"
        );
        let rabbit = rabbitmq::bench::RabbitBenchParams {
            uri: "amqp://127.0.0.1:9/%2f".into(),
            messages: 10,
            dup_rate: 0.1,
            seed: 1,
            prefetch: 0,
            handler: None,
            shards: None,
            dir: dir.clone(),
        };
        let e = rabbitmq::bench::run(&rabbit, &mut |_, _, _| {}).unwrap_err();
        assert_eq!(
            e.to_string(),
            "prefetch (--prefetch) must be at least 1, got 0"
        );
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    }
}
