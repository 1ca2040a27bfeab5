//! The `dedupd` command line: parse, load config, init tracing, run. Only here lives anyhow.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use dedupd::admin::{AdminState, HttpConfig};
use dedupd::bench::{self, BenchParams, BenchReport, Progress};
use dedupd::clock::SystemClock;
use dedupd::config::Config;
use dedupd::ledger::Ledger;
use dedupd::pipeline::run_pipe;
use dedupd::source::kafka;

/// Shard writers free what sources allocate (ids, payloads, batches); mimalloc handles that
/// cross-thread pattern with far less contention than glibc malloc (measured in the bench).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (its index in `mi_option_t`; libmimalloc-sys names only
/// some options).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory committed for 10 s instead of mimalloc's default 1 s before giving it
/// back to the OS. Shards free and reallocate batch-sized buffers continuously; with the
/// default, those pages were purged and faulted back in (as zeroed transparent huge pages)
/// all the time: 5,000-8,000 faults and 10-12 % more CPU per million shipping-label messages,
/// ~1,000 faults with this setting (`perf stat -e page-faults,task-clock dedupd bench ...`).
/// Memory is still returned when idle.
fn tune_allocator() {
    // SAFETY: `mi_option_set` only stores an integer in mimalloc's option table; the index
    // is `mi_option_purge_delay` of the bundled mimalloc v3 header, and any value is valid.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 10_000);
    }
}

#[derive(Parser)]
#[command(
    name = "dedupd",
    version,
    about = "Effectively-once consumer engine: durable claims, dedup, quarantine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// JSON lines on stdin, one durable outcome line per input line on stdout.
    Pipe {
        /// Data directory (created on first use).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// TOML config file (see dedupd.example.toml).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The long-running engine. With a `[kafka]` section it consumes the configured
    /// subscriptions and relays the outbox until SIGTERM/SIGINT (then it drains, stores and
    /// commits offsets, and exits 0); without one it runs the stdin pipe. With an `[http]`
    /// section it also serves the admin and ingest API (and keeps serving after stdin ends,
    /// until SIGINT/SIGTERM).
    Run {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
    /// Only the admin and ingest HTTP API, until SIGINT/SIGTERM.
    Serve {
        /// TOML config file; its `[http]` section sets bind address, token and limits.
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Listen here instead of `http.bind`.
        #[arg(long)]
        bind: Option<std::net::SocketAddr>,
    },
    /// A self-contained tour on a temporary data directory.
    Demo {
        /// Messages in the first stream.
        #[arg(long, default_value_t = 1_000_000)]
        messages: u64,
        /// Handler component run for each new order event (`none` for claims only).
        #[arg(long, default_value = DEFAULT_DEMO_HANDLER)]
        handler: String,
    },
    /// Work with handler components.
    Handler {
        #[command(subcommand)]
        command: HandlerCommand,
    },
    /// Work with handler state.
    State {
        #[command(subcommand)]
        command: StateCommand,
    },
    /// In-process load with a fixed seed, and a naive redb baseline in the same run.
    Bench {
        #[arg(long, default_value_t = 10_000_000)]
        messages: u64,
        /// Fraction of messages that redeliver an earlier message.
        #[arg(long, default_value_t = 0.1)]
        dup_rate: f64,
        /// Fraction of messages that reuse an id with another payload.
        #[arg(long, default_value_t = 0.0)]
        mismatch_rate: f64,
        #[arg(long, default_value_t = 1)]
        subscribers: u32,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Most messages in flight (handed to the engine, outcome not yet released).
        #[arg(long, default_value_t = 8_192)]
        window: u64,
        /// Messages for the naive baseline (default: same as --messages; 0 skips it).
        #[arg(long)]
        naive_messages: Option<u64>,
        /// Shards (default: number of cores).
        #[arg(long)]
        shards: Option<usize>,
        /// Directory in which the temporary data directory is created.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// Keep the data directory.
        #[arg(long)]
        keep: bool,
        /// TOML config for ledger settings.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Run this handler component for every new message.
        #[arg(long)]
        handler: Option<PathBuf>,
        /// Order ids as random 16-hex-digit strings (like UUIDs or hashes) instead of
        /// numbers in sequence: handler state keys then land anywhere in the sorted tables.
        #[arg(long)]
        random_order_ids: bool,
        /// With --handler: the subscribers' partition key, a JSON pointer into the payload
        /// (as the docs recommend for per-order state), or `none` to run each subscriber's
        /// handler on one shard. Ignored when --config sets a partition key.
        #[arg(long, default_value = "/order_id")]
        partition_key: String,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Starts librdkafka's mock Kafka cluster on loopback, prints its bootstrap address on
    /// stdout, and serves until SIGTERM/SIGINT. For development and tests only (in memory).
    DevBroker {
        /// Brokers in the cluster.
        #[arg(long, default_value_t = 1)]
        brokers: i32,
        /// Topics to create up front, as NAME or NAME:PARTITIONS (others are auto-created
        /// with 4 partitions).
        #[arg(long = "topic")]
        topics: Vec<String>,
    },
    /// Kafka source against a consume-only rdkafka baseline on the mock broker, same run.
    KafkaBench {
        #[arg(long, default_value_t = 2_000_000)]
        messages: u64,
        /// Fraction of messages that redeliver an earlier message.
        #[arg(long, default_value_t = 0.1)]
        dup_rate: f64,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        #[arg(long, default_value_t = 4)]
        partitions: i32,
        /// Messages of the paced phase that measures end-to-end latency (0 skips it).
        #[arg(long, default_value_t = 200_000)]
        live_messages: u64,
        /// Handler component run for every new message.
        #[arg(long)]
        handler: Option<PathBuf>,
        #[arg(long)]
        shards: Option<usize>,
        /// Directory in which the temporary data directory is created.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// Use this cluster instead of the built-in mock broker.
        #[arg(long)]
        brokers: Option<String>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Per-subscriber counts, generations, file size and filter memory of a data directory.
    Inspect {
        #[arg(long)]
        data_dir: PathBuf,
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum HandlerCommand {
    /// Validate a component against the WIT contract and the capability allow-list, and
    /// list its imports and exports.
    Check {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum StateCommand {
    /// Print a subscriber's handler state as JSON lines: {"key": ..., "value": ...}.
    Dump {
        #[arg(long)]
        data_dir: PathBuf,
        #[arg(long)]
        subscriber: String,
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

const DEFAULT_DEMO_HANDLER: &str = "plugins/target/wasm32-wasip2/release/shipping_label.wasm";

fn main() -> ExitCode {
    tune_allocator();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dedupd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(path: Option<&Path>) -> Result<Config> {
    match path {
        Some(p) => Ok(Config::load(p)?),
        None => Ok(Config::default()),
    }
}

fn data_dir(flag: Option<PathBuf>, config: &Config) -> Result<PathBuf> {
    match flag.or_else(|| config.data_dir.clone()) {
        Some(d) => Ok(d),
        None => bail!("no data directory: pass --data-dir DIR or set data_dir in the config"),
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Pipe {
            data_dir: dir,
            config,
        } => {
            let config = load_config(config.as_deref())?;
            pipe(&data_dir(dir, &config)?, &config)
        }
        Command::Handler {
            command: HandlerCommand::Check { file, json },
        } => {
            let component = dedupd::handler::Component::load(&file, Default::default())?;
            let r = component.report();
            if json {
                println!("{}", serde_json::to_string_pretty(r)?);
            } else {
                println!(
                    "ok: {} ({} bytes, version {})",
                    r.path.display(),
                    r.bytes,
                    r.version
                );
                for i in &r.imports {
                    println!("  import {i}");
                }
                for e in &r.exports {
                    println!("  export {e}");
                }
            }
            Ok(())
        }
        Command::State {
            command:
                StateCommand::Dump {
                    data_dir,
                    subscriber,
                    config,
                },
        } => {
            let config = load_config(config.as_deref())?;
            require_data_dir(&data_dir)?;
            let ledger = Ledger::open(&data_dir, &config, Arc::new(SystemClock))?;
            let entries = ledger.state_entries(&subscriber);
            // Under an entity placement each key is stored as `entity NUL key`.
            let scoped = ledger.subscriber(&subscriber)?.state_per_entity();
            ledger.close()?;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            for (k, v) in entries? {
                let line = match k.iter().position(|b| *b == 0).filter(|_| scoped) {
                    Some(at) => serde_json::json!({
                        "entity": readable(&k[..at]),
                        "key": readable(&k[at + 1..]),
                        "value": readable(&v),
                    }),
                    None => serde_json::json!({"key": readable(&k), "value": readable(&v)}),
                };
                writeln!(out, "{line}")?;
            }
            out.flush()?;
            Ok(())
        }
        Command::Run {
            config,
            data_dir: dir,
        } => {
            let config = load_config(Some(&config))?;
            let dir = data_dir(dir, &config)?;
            match (config.kafka.clone(), config.http.clone()) {
                (None, None) => pipe(&dir, &config),
                (None, Some(http)) => run_with_http(&dir, &config, http, true),
                (Some(kafka), http) => run_kafka(&dir, &config, &kafka, http),
            }
        }
        Command::Serve {
            config,
            data_dir: dir,
            bind,
        } => {
            let config = load_config(config.as_deref())?;
            let dir = data_dir(dir, &config)?;
            let mut http = config.http.clone().unwrap_or_default();
            if let Some(b) = bind {
                http.bind = b;
            }
            run_with_http(&dir, &config, http, false)
        }
        Command::DevBroker { brokers, topics } => dev_broker(brokers, &topics),
        Command::KafkaBench {
            messages,
            dup_rate,
            seed,
            partitions,
            live_messages,
            handler,
            shards,
            dir,
            brokers,
            json,
        } => {
            if !(0.0..1.0).contains(&dup_rate) {
                bail!("--dup-rate must be in [0, 1)");
            }
            if messages == 0 || partitions < 1 {
                bail!("--messages and --partitions must be at least 1");
            }
            if let Some(h) = &handler {
                if !h.exists() {
                    bail!(
                        "handler {} not found: build the plugins first (plugins/build.sh)",
                        h.display()
                    );
                }
            }
            let params = kafka::bench::KafkaBenchParams {
                messages,
                dup_rate,
                seed,
                partitions,
                live_messages,
                handler,
                shards,
                dir,
                brokers,
            };
            eprintln!("kafka-bench: {messages} messages, dup rate {dup_rate}, seed {seed}, {partitions} partitions, handler {}, then {live_messages} paced messages for end-to-end latency", params.handler.as_ref().map(|h| h.display().to_string()).unwrap_or_else(|| "none".into()));
            let report = kafka::bench::run(&params, &mut |p| {
                let rate = p.done as f64 / p.elapsed.as_secs_f64().max(1e-9);
                let mut err = std::io::stderr().lock();
                let _ = write!(
                    err,
                    "\r{:>8} {:>5.1}%  {:>10} msgs  {:>9.0} msgs/s   ",
                    p.phase,
                    100.0 * p.done as f64 / p.total.max(1) as f64,
                    p.done,
                    rate
                );
                let _ = err.flush();
            })?;
            eprintln!();
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "baseline  {:>12.0} msgs/s  consume only, producing alongside ({:.2} s)",
                    report.baseline_msgs_per_sec, report.baseline_s
                );
                println!("engine    {:>12.0} msgs/s  consume -> dedup -> handler -> offsets stored, producing alongside ({:.2} s)", report.engine_msgs_per_sec, report.engine_s);
                println!("ratio     {:>12.2}x  engine / baseline", report.ratio);
                println!(
                    "outcomes  processed {}  duplicate {}  quarantined {}  dead-lettered {}",
                    report.processed, report.duplicate, report.quarantined, report.dead_lettered
                );
                println!("lead      p99 {:.1} ms from produce timestamp to offset stored (producer up to {} messages ahead)", report.backlog_p99_ms, kafka::bench::WINDOW);
                if report.params.live_messages > 0 {
                    println!("live      {:.0} msgs/s paced: produce timestamp -> offset stored p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms", report.live_rate, report.live_p50_ms, report.live_p99_ms, report.live_max_ms);
                }
            }
            Ok(())
        }
        Command::Demo { messages, handler } => {
            let handler = (handler != "none").then(|| PathBuf::from(handler));
            if let Some(h) = &handler {
                if !h.exists() {
                    bail!("handler {} not found: build the plugins first (plugins/build.sh), or pass --handler none", h.display());
                }
            }
            demo(messages, handler)
        }
        Command::Bench {
            messages,
            dup_rate,
            mismatch_rate,
            subscribers,
            seed,
            window,
            naive_messages,
            shards,
            dir,
            keep,
            config,
            handler,
            random_order_ids,
            partition_key,
            json,
        } => {
            if !(0.0..1.0).contains(&dup_rate)
                || !(0.0..1.0).contains(&mismatch_rate)
                || dup_rate + mismatch_rate >= 1.0
            {
                bail!("--dup-rate and --mismatch-rate must be in [0, 1) and sum to less than 1");
            }
            if messages == 0 {
                bail!("--messages must be at least 1");
            }
            let mut config = load_config(config.as_deref())?;
            if let Some(n) = shards {
                config.ledger.shards =
                    Some(std::num::NonZeroUsize::new(n).context("--shards must be at least 1")?);
            }
            let params = BenchParams {
                messages,
                dup_rate,
                mismatch_rate,
                subscribers,
                seed,
                window,
                naive_messages: naive_messages.unwrap_or(messages),
                random_order_ids,
                dir,
                keep,
                partition_pointer: (partition_key != "none").then(|| partition_key.clone()),
                handler,
                config,
            };
            let effective = bench::bench_config(&params).defaults.partition_key;
            eprintln!(
                "bench: {messages} messages, dup rate {dup_rate}, mismatch rate {mismatch_rate}, {subscribers} subscriber(s), seed {seed}, window {window}, durable commits{}{}",
                if random_order_ids { ", random order ids" } else { "" },
                if params.handler.is_some() { format!(", partition key {effective:?}") } else { String::new() }
            );
            let report = bench::run(&params, print_progress)?;
            eprintln!();
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print_bench(&report);
            }
            if !report.verified {
                bail!("outcomes did not match the generated traffic");
            }
            Ok(())
        }
        Command::Inspect {
            data_dir,
            config,
            json,
        } => {
            let config = load_config(config.as_deref())?;
            if !data_dir.join("dedupd.manifest.json").exists() {
                bail!(
                    "{} is not a dedupd data directory (no dedupd.manifest.json)",
                    data_dir.display()
                );
            }
            let ledger = Ledger::open(&data_dir, &config, Arc::new(SystemClock))?;
            let report = ledger.report()?;
            ledger.close()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("data dir     {}", report.data_dir.display());
                println!("format       v{}", report.format_version);
                println!("shards       {}", report.shards);
                println!("file bytes   {}", report.file_bytes);
                // Outcomes counted / records stored (repeats of one message share a record).
                println!(
                    "{:<24} {:>12} {:>10} {:>6} {:>17} {:>17} {:>12} {:>12}",
                    "subscriber",
                    "claims",
                    "active",
                    "gens",
                    "quarantined/recs",
                    "dead_letter/recs",
                    "filter B",
                    "index B"
                );
                for s in &report.subscribers {
                    println!(
                        "{:<24} {:>12} {:>10} {:>6} {:>17} {:>17} {:>12} {:>12}",
                        s.subscriber,
                        s.claims,
                        s.active_claims,
                        s.sealed_generations,
                        format!("{}/{}", s.quarantined, s.quarantine_records),
                        format!("{}/{}", s.dead_lettered, s.dead_letter_records),
                        s.filter_bytes,
                        s.index_bytes
                    );
                }
            }
            Ok(())
        }
    }
}

/// Refuses to create a data directory where the user meant to read one.
fn require_data_dir(dir: &Path) -> Result<()> {
    if !dir.join("dedupd.manifest.json").exists() {
        bail!(
            "{} is not a dedupd data directory (no dedupd.manifest.json)",
            dir.display()
        );
    }
    Ok(())
}

/// Bytes as JSON: parsed JSON if they are JSON, a string if UTF-8, else hex.
fn readable(bytes: &[u8]) -> serde_json::Value {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
        return v;
    }
    match std::str::from_utf8(bytes) {
        Ok(s) => serde_json::Value::String(s.to_string()),
        Err(_) => {
            serde_json::json!({ "hex": bytes.iter().map(|b| format!("{b:02x}")).collect::<String>() })
        }
    }
}

fn pipe(dir: &Path, config: &Config) -> Result<()> {
    let ledger = Ledger::open(dir, config, Arc::new(SystemClock))?;
    dedupd::pipeline::install_handlers(&ledger, config)?;
    let stdin = std::io::stdin().lock();
    let stdout = std::io::stdout();
    let done = std::sync::atomic::AtomicBool::new(false);
    let result = std::thread::scope(|scope| {
        // Fail-stop (G7): after a storage error or a shard writer's panic nothing more is
        // acknowledged, and the process must not wait for stdin to close before it exits
        // non-zero.
        scope.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(100));
                if let Some(reason) = ledger.poison_reason() {
                    // Give the printer a moment to flush the lines that were durable.
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    eprintln!("dedupd: the ledger stopped: {reason}");
                    std::process::exit(1);
                }
            }
        });
        let r = run_pipe(&ledger, config, stdin, stdout);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    });
    let closed = ledger.close();
    let summary = result?;
    closed?;
    tracing::info!(
        ?summary,
        "input ended; every outcome is durable and printed"
    );
    Ok(())
}

/// The admin and ingest HTTP server, running on its own tokio runtime.
struct HttpServer {
    runtime: tokio::runtime::Runtime,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    stop_tx: tokio::sync::oneshot::Sender<()>,
}

/// Starts the HTTP API over `ledger`. It stops on [`HttpServer::stop`], on SIGINT/SIGTERM
/// when `signals` is set, or when the ledger fails (G7).
fn start_http(
    ledger: &Arc<Ledger>,
    config: &Config,
    http: HttpConfig,
    signals: bool,
) -> Result<HttpServer> {
    let token = http.resolve_token()?;
    dedupd::admin::install_metrics();
    let listener = std::net::TcpListener::bind(http.bind)
        .with_context(|| format!("cannot listen on {} (http.bind)", http.bind))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let mut config = config.clone();
    config.http = Some(http);
    let state = AdminState::new(ledger.clone(), &config, token)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("dedupd-http")
        .build()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let watched = ledger.clone();
    let task = runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let shutdown = async move {
            let poisoned = async {
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    if watched.poison_reason().is_some() {
                        return;
                    }
                }
            };
            let signalled = async {
                if signals {
                    termination().await
                } else {
                    std::future::pending().await
                }
            };
            tokio::select! {
                _ = stop_rx => {}
                _ = signalled => {}
                _ = poisoned => {}
            }
        };
        dedupd::admin::serve(listener, state, shutdown).await
    });
    eprintln!("dedupd: HTTP API on http://{addr} (dashboard at /, OpenAPI at /openapi.json)");
    Ok(HttpServer {
        runtime,
        task,
        stop_tx,
    })
}

impl HttpServer {
    /// Waits until the server stops by itself (signal or ledger failure).
    fn wait(self) -> Result<()> {
        let HttpServer {
            runtime,
            task,
            stop_tx,
        } = self;
        let served = runtime.block_on(task);
        drop(stop_tx);
        runtime.shutdown_timeout(std::time::Duration::from_secs(5));
        served.context("HTTP server task failed")??;
        Ok(())
    }

    /// Stops accepting requests, lets requests in progress finish, and waits.
    fn stop(self) -> Result<()> {
        let _ = self.stop_tx.send(());
        let served = self.runtime.block_on(self.task);
        self.runtime
            .shutdown_timeout(std::time::Duration::from_secs(5));
        served.context("HTTP server task failed")??;
        Ok(())
    }
}

/// The HTTP API (and, with `stdin`, pipe mode on stdin) over one ledger, until SIGINT or
/// SIGTERM. A storage error or a shard writer's panic stops everything and exits non-zero
/// (G7).
fn run_with_http(dir: &Path, config: &Config, http: HttpConfig, stdin: bool) -> Result<()> {
    let ledger = Arc::new(Ledger::open(dir, config, Arc::new(SystemClock))?);
    dedupd::pipeline::install_handlers(&ledger, config)?;
    let server = start_http(&ledger, config, http, true)?;
    if stdin {
        let config2 = config.clone();
        let ledger2 = ledger.clone();
        // Pipe mode on its own thread, so a signal ends the process even while stdin is open.
        std::thread::Builder::new()
            .name("dedupd-stdin".into())
            .spawn(move || {
                let r = run_pipe(
                    &ledger2,
                    &config2,
                    std::io::stdin().lock(),
                    std::io::stdout(),
                );
                if let Err(e) = r {
                    eprintln!("dedupd: stdin source stopped: {e}");
                }
            })?;
    }
    server.wait()?;
    if let Some(reason) = ledger.poison_reason() {
        bail!("the ledger stopped: {reason}");
    }
    // If the stdin thread still holds the ledger, the process exits and the OS closes the
    // files; every acknowledged outcome was committed before it was acknowledged (G1).
    if let Ok(l) = Arc::try_unwrap(ledger) {
        l.close()?;
    }
    Ok(())
}

/// Set by SIGTERM or SIGINT.
fn stop_flag() -> Result<Arc<std::sync::atomic::AtomicBool>> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone())
            .with_context(|| format!("cannot install a handler for signal {sig}"))?;
    }
    Ok(stop)
}

/// The Kafka source (and the HTTP API when configured) over one ledger, until SIGINT or
/// SIGTERM: then the API stops taking requests, the consumers drain and store their
/// offsets, and the outbox is relayed.
fn run_kafka(
    dir: &Path,
    config: &Config,
    kafka_config: &kafka::KafkaConfig,
    http: Option<HttpConfig>,
) -> Result<()> {
    let stop = stop_flag()?;
    // librdkafka can block a consumer's close for long when no broker answers; durable
    // outcomes are safe without it (uncommitted offsets only mean redelivery), so a stop
    // that takes far longer than the drain allows ends the process.
    let limit = kafka_config.drain_timeout * 2 + std::time::Duration::from_secs(10);
    let watchdog_stop = stop.clone();
    std::thread::spawn(move || {
        while !watchdog_stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        std::thread::sleep(limit);
        eprintln!("dedupd: shutdown did not finish within {limit:?} (Kafka unreachable?); exiting; uncommitted offsets will be redelivered as duplicates");
        std::process::exit(1);
    });
    // Sources that record through the metrics facade before the server starts are kept.
    dedupd::admin::install_metrics();
    let ledger = Arc::new(Ledger::open(dir, config, Arc::new(SystemClock))?);
    dedupd::pipeline::install_handlers(&ledger, config)?;
    let server = match http {
        Some(http) => Some(start_http(&ledger, config, http, false)?),
        None => None,
    };
    let result = kafka::run(ledger.clone(), kafka_config, &stop);
    if let Some(server) = server {
        server.stop()?;
    }
    let closed = match Arc::try_unwrap(ledger) {
        Ok(l) => l.close(),
        Err(_) => Ok(()),
    };
    let summary = result?;
    closed?;
    println!("{}", serde_json::json!({ "kafka": summary }));
    tracing::info!(
        ?summary,
        "stopped; every stored offset covers durable outcomes"
    );
    Ok(())
}

fn dev_broker(brokers: i32, topics: &[String]) -> Result<()> {
    let stop = stop_flag()?;
    let broker = kafka::DevBroker::start(brokers)?;
    for t in topics {
        let (name, partitions) = match t.split_once(':') {
            Some((n, p)) => (
                n,
                p.parse::<i32>()
                    .with_context(|| format!("--topic {t}: partitions must be a number"))?,
            ),
            None => (t.as_str(), 4),
        };
        broker.create_topic(name, partitions)?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", broker.bootstrap_servers())?;
    out.flush()?;
    drop(out);
    eprintln!(
        "dedupd dev-broker: mock Kafka cluster at {} (in memory; stop with Ctrl-C)",
        broker.bootstrap_servers()
    );
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Ok(())
}

async fn termination() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn print_progress(p: Progress) {
    let rate = p.done as f64 / p.elapsed.as_secs_f64().max(1e-9);
    let mut err = std::io::stderr().lock();
    let _ = write!(
        err,
        "\r{:>6} {:>5.1}%  {:>10} msgs  {:>9.0} msgs/s  p99 {:>7.2} ms   ",
        p.phase,
        100.0 * p.done as f64 / p.total.max(1) as f64,
        p.done,
        rate,
        p.p99_ms
    );
    let _ = err.flush();
}

fn print_bench(r: &BenchReport) {
    println!(
        "engine   {:>12.0} msgs/s  ({} msgs in {:.2} s, {} shards, mean batch {:.0})",
        r.msgs_per_sec, r.params.messages, r.elapsed_s, r.shards, r.mean_batch
    );
    println!(
        "acks     p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
        r.p50_ack_ms, r.p99_ack_ms, r.max_ack_ms
    );
    println!(
        "outcomes processed {}  duplicate {}  quarantined {}  verified {}",
        r.processed, r.duplicates, r.quarantined, r.verified
    );
    println!("batches  longest {:.1} ms plain, {:.1} ms with sealing/merging ({} seals, {} merges); longest commit {:.1} ms", r.max_batch_ms_plain, r.max_batch_ms_with_maintenance, r.seals, r.merges, r.max_commit_ms);
    // The per-key slope needs samples past the warm-up (two generations per shard); short
    // runs do not get there.
    let per_key = if r.rss_bytes_per_key.is_finite() {
        format!(
            "{:.2} B/key RSS beyond a base of {:.1} MiB",
            r.rss_bytes_per_key,
            r.rss_base_bytes as f64 / 1048576.0
        )
    } else {
        "RSS per key n/a (run too short to pass the warm-up of two generations per shard)".into()
    };
    println!(
        "memory   {per_key} (max RSS {:.1} MiB; {:.2} B/key in filters); {} keys",
        r.rss_max_bytes as f64 / 1048576.0,
        r.filter_bytes_per_key,
        r.stored_keys
    );
    println!(
        "disk     {:.1} MiB ({:.1} B/key)",
        r.disk_bytes as f64 / 1048576.0,
        r.disk_bytes as f64 / r.stored_keys.max(1) as f64
    );
    println!(
        "filters  {} probes, false-positive rate {:.5}%",
        r.filter_probes,
        100.0 * r.filter_false_positive_rate
    );
    if let Some(h) = &r.params.handler {
        println!(
            "handler  {} ({} state entries, {} dead-lettered)",
            h.display(),
            r.state_entries,
            r.dead_lettered
        );
    }
    if r.naive_messages > 0 {
        println!(
            "naive    {:>12.0} msgs/s  ({} msgs, batch {})  engine/naive = {:.1}x",
            r.naive_msgs_per_sec, r.naive_messages, r.naive_batch, r.engine_over_naive
        );
    }
}

fn demo(messages: u64, handler: Option<PathBuf>) -> Result<()> {
    eprintln!("dedupd demo: {messages} OrderPlaced events for 3 subscribers, 12% redeliveries, 0.2% reused ids with other payloads, 2% new events for an order seen before; durable commits on a temporary data directory");
    match &handler {
        Some(h) => eprintln!("handler: {} (one shipping label per order)", h.display()),
        None => eprintln!("handler: none (claims only)"),
    }
    let report = dedupd::demo::run(
        messages,
        PathBuf::from("."),
        handler.clone(),
        print_progress,
    )?;
    eprintln!();
    let r = &report.run;
    println!(
        "throughput     {:.0} msgs/s ({} msgs in {:.2} s)",
        r.msgs_per_sec, messages, r.elapsed_s
    );
    println!(
        "outcomes       {} processed, {} duplicates skipped ({:.1}%), {} quarantined",
        r.processed,
        r.duplicates,
        100.0 * r.duplicates as f64 / messages as f64,
        r.quarantined
    );
    println!(
        "ack latency    p50 {:.2} ms, p99 {:.2} ms",
        r.p50_ack_ms, r.p99_ack_ms
    );
    println!(
        "on disk        {:.1} MiB for {} claims",
        r.disk_bytes as f64 / 1048576.0,
        r.stored_keys
    );
    if handler.is_some() {
        println!("labels         {} created for {} processed events ({} events repeated an order and made no label); {} dead-lettered",
            r.state_entries, r.processed, r.processed - r.state_entries, r.dead_lettered);
    }
    println!("verified       {}", r.verified);
    println!("restart + redelivery of the first {} messages: {} processed again, {} duplicates, {} quarantined; labels {} -> {}",
        report.redelivered, report.redelivered_processed_again, report.redelivered_duplicates, report.redelivered_quarantined,
        r.state_entries, report.labels_after_redelivery);
    if !r.verified
        || report.redelivered_processed_again != 0
        || report.labels_after_redelivery != r.state_entries
    {
        bail!("the demo saw a wrong outcome");
    }
    Ok(())
}
