//! The `dedupd` command line: parse (`args.rs`), load config, init tracing, run a library
//! entry point, print. Only the binary uses anyhow.

mod args;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Parser;

use args::{
    data_dir, load_config, Cli, Command, ConfigCommand, HandlerCommand, LogFormat, StateCommand,
};
use dedupd::pipeline::{self, Mode, Summary};
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

/// Logs to stderr, as text or JSON lines, at `RUST_LOG`'s levels or the command's default:
/// the long-running commands say what they do at `info`, the others only what went wrong.
fn init_logs(format: LogFormat, command: &Command) {
    let default = match command {
        Command::Run { .. } | Command::Serve { .. } => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only for a person at a terminal: a log file or journald gets plain text.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_env_filter(filter);
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    init_logs(cli.log_format, &cli.command);
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dedupd: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each said once: many of our errors name their cause in their
/// own text already (`cannot read config file x.toml: No such file...`), and anyhow's
/// alternate form would repeat it after a colon.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Pipe {
            data_dir: dir,
            config,
        } => {
            let config = load_config(config.as_deref())?;
            pipeline::run(&config, &data_dir(dir, &config)?, Mode::Pipe)?;
        }
        Command::Run {
            config,
            data_dir: dir,
            metrics_bind,
        } => {
            let mut config = load_config(Some(&config))?;
            if let Some(bind) = metrics_bind {
                config.metrics = Some(dedupd::config::MetricsConfig { bind });
            }
            let summary = pipeline::run(&config, &data_dir(dir, &config)?, Mode::of(&config))?;
            match summary {
                Summary::Kafka(kafka) => println!("{}", serde_json::json!({ "kafka": kafka })),
                Summary::Nats(nats) => println!("{}", serde_json::json!({ "nats": nats })),
                _ => {}
            }
        }
        Command::Serve {
            config,
            data_dir: dir,
            bind,
        } => {
            let config = load_config(config.as_deref())?;
            let mut http = config.http.clone().unwrap_or_default();
            http.bind = bind.unwrap_or(http.bind);
            let mode = Mode::Serve { http, stdin: false };
            pipeline::run(&config, &data_dir(dir, &config)?, mode)?;
        }
        Command::Config {
            command: ConfigCommand::Check { file, json },
        } => {
            let report = pipeline::check_file(&file)?;
            match json {
                true => println!("{}", serde_json::to_string_pretty(&report)?),
                false => print!("{report}"),
            }
        }
        Command::Handler {
            command: HandlerCommand::Check { file, json },
        } => {
            let component = dedupd::handler::Component::load(&file, Default::default())?;
            match json {
                true => println!("{}", serde_json::to_string_pretty(component.report())?),
                false => print!("{}", component.report()),
            }
        }
        Command::Handler {
            command: HandlerCommand::Test(args),
        } => handler_test(args)?,
        Command::Handler {
            command: HandlerCommand::New { name, lang, dir },
        } => {
            let project = dedupd::scaffold::create(&dir, &name, lang.parse()?)?;
            println!(
                "created {} ({} files)\n\nnext:\n{}",
                project.dir.display(),
                project.files.len(),
                project.next_steps()
            );
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
            dedupd::inspect::dump_state(&data_dir, &config, &subscriber, std::io::stdout().lock())?;
        }
        Command::Inspect {
            data_dir,
            repair,
            config,
            json,
        } => {
            let report = match repair {
                false => dedupd::inspect::inspect(&data_dir)?,
                true => {
                    dedupd::inspect::inspect_repairing(&data_dir, &load_config(config.as_deref())?)?
                }
            };
            match json {
                true => println!("{}", serde_json::to_string_pretty(&report)?),
                false => dedupd::inspect::write_table(&report, std::io::stdout().lock())?,
            }
        }
        Command::Backup { data_dir, to, json } => {
            let report = dedupd::backup::backup_offline(&data_dir, &to)?;
            match json {
                true => println!("{}", serde_json::to_string_pretty(&report)?),
                false => println!(
                    "backup {}: {} files, {} bytes, checksums in {}",
                    to.display(),
                    report.manifest.files.len(),
                    report.bytes,
                    dedupd::backup::BACKUP_MANIFEST
                ),
            }
        }
        Command::Restore {
            from,
            data_dir,
            check,
            json,
        } => restore(&from, data_dir.filter(|_| !check), json)?,
        Command::DevBroker { brokers, topics } => dev_broker(brokers, &topics)?,
        Command::Version => println!("dedupd {}", dedupd::version_text()),
        Command::Completions { shell } => {
            let mut cmd = <args::Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "dedupd", &mut std::io::stdout());
        }
        Command::Man => {
            let cmd = <args::Cli as clap::CommandFactory>::command();
            clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?;
        }
        Command::Demo { messages, handler } => demo(messages, args::demo_handler(&handler)?)?,
        Command::Bench(mut args) => {
            if let Some(args::BenchCommand::Adversarial(a)) = args.command.take() {
                return bench_adversarial(a);
            }
            let (json, series) = (args.json, args.series);
            let params = args.params()?;
            eprintln!("{params}");
            let report = dedupd::bench::run(&params, |p| progress(&p))?;
            end_progress();
            match json {
                true => println!("{}", serde_json::to_string(&report)?),
                false => print!("{report}"),
            }
            for p in report.series.iter().filter(|_| series && !json) {
                let per = |bytes: u64| bytes as f64 / p.processed.max(1) as f64;
                println!(
                    "series   {:>12} msgs  {:>10.0} msgs/s  {:>12} processed  resident {:>7.1} MiB  disk {:>8.1} MiB ({:>5.1} B/processed)",
                    p.messages,
                    p.msgs_per_sec,
                    p.processed,
                    p.rss_bytes as f64 / (1 << 20) as f64,
                    p.disk_allocated_bytes as f64 / (1 << 20) as f64,
                    per(p.disk_allocated_bytes)
                );
            }
            if !report.verified {
                bail!("outcomes did not match the generated traffic");
            }
        }
        Command::KafkaBench(args) => {
            let json = args.json;
            let params = args.params()?;
            eprintln!("{params}");
            let report = kafka::bench::run(&params, &mut |p| progress(&p))?;
            end_progress();
            match json {
                true => println!("{}", serde_json::to_string(&report)?),
                false => print!("{report}"),
            }
        }
    }
    Ok(())
}

/// `dedupd bench adversarial`.
fn bench_adversarial(args: args::AdversarialArgs) -> Result<()> {
    let json = args.json;
    let params = args.params()?;
    let report = dedupd::bench::run_adversarial(&params, |phase| eprintln!("== {phase}"))?;
    match json {
        true => println!("{}", serde_json::to_string(&report)?),
        false => print!("{report}"),
    }
    if !report.verified() {
        bail!("outcomes, claims or counts differ from the traffic (lines marked PROBLEM)");
    }
    Ok(())
}

/// `dedupd handler test`.
fn handler_test(args: args::HandlerTestArgs) -> Result<()> {
    use dedupd::harness;
    if !args.file.exists() {
        bail!("handler {} not found", args.file.display());
    }
    let messages = harness::read_messages(&args.input)?;
    let seed = match &args.state {
        Some(p) => harness::read_state(p)?,
        None => harness::Seed::default(),
    };
    let expected = match &args.expect {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?,
        ),
        None => None,
    };
    let options = harness::Options {
        component: args.file,
        config: load_config(args.config.as_deref())?,
        subscriber: args.subscriber,
        now_ms: args.now_ms,
        cpu_budget: args.cpu_budget,
    };
    let reports = harness::run(&options, &messages, &seed)?;
    if let (Some(path), Some(expected)) = (&args.expect, expected) {
        let file = path.display().to_string();
        match harness::compare(&file, &expected, &reports) {
            Ok(n) => println!("ok: {n} messages as expected in {file}"),
            Err(diff) => {
                eprint!("{diff}");
                bail!("the output differs from {file}");
            }
        }
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    match args.json {
        true => out.write_all(harness::json_lines(&reports).as_bytes())?,
        false => harness::write_human(&reports, &mut out)?,
    }
    out.flush()?;
    Ok(())
}

/// `dedupd restore`: verify only (no data directory), or verify, restore and load.
fn restore(from: &std::path::Path, data_dir: Option<PathBuf>, json: bool) -> Result<()> {
    let Some(data_dir) = data_dir else {
        let manifest = dedupd::backup::verify(from)?;
        match json {
            true => println!("{}", serde_json::to_string_pretty(&manifest)?),
            false => println!(
                "backup {}: {} files verified (taken {}, dedupd {})",
                from.display(),
                manifest.files.len(),
                if manifest.online { "online" } else { "offline" },
                manifest.dedupd_version
            ),
        }
        return Ok(());
    };
    let (manifest, report) = dedupd::backup::restore(from, &data_dir)?;
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"backup": manifest, "restored": report})
            )?
        ),
        false => {
            println!(
                "restored {} files from {} into {}; it opens read-only:",
                manifest.files.len(),
                from.display(),
                data_dir.display()
            );
            dedupd::inspect::write_table(&report, std::io::stdout().lock())?;
        }
    }
    Ok(())
}

/// Rewrites the live progress line on stderr.
/// A progress line: rewritten in place on a terminal; elsewhere (a log file, journald, a
/// pipe) a plain line at most every [`PROGRESS_EVERY`], so `\r` updates never pile onto one
/// line of a log.
fn progress(line: &dyn std::fmt::Display) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut err = std::io::stderr().lock();
    if err.is_terminal() {
        let _ = write!(err, "\r{line}   ");
        let _ = err.flush();
        return;
    }
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
        *last = Some(std::time::Instant::now());
        let _ = writeln!(err, "{line}");
    }
}

/// How often progress is printed when stderr is not a terminal.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Ends a progress line on a terminal (elsewhere every progress line is whole already).
fn end_progress() {
    if std::io::stderr().is_terminal() {
        eprintln!();
    }
}

fn dev_broker(brokers: i32, topics: &[String]) -> Result<()> {
    let shutdown = pipeline::Shutdown::new();
    shutdown.on_signals()?;
    let broker = kafka::DevBroker::start(brokers)?;
    for t in topics {
        let (name, partitions) = args::topic(t)?;
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
    shutdown.wait();
    Ok(())
}

fn demo(messages: u64, handler: Option<PathBuf>) -> Result<()> {
    eprintln!("dedupd demo: {messages} OrderPlaced events for 3 subscribers, 12% redeliveries, 0.2% reused ids with other payloads, 2% new events for an order seen before; durable commits on a temporary data directory");
    match &handler {
        Some(h) => eprintln!("handler: {} (one shipping label per order)", h.display()),
        None => eprintln!("handler: none (claims only)"),
    }
    let report = dedupd::demo::run(messages, PathBuf::from("."), handler, |p| progress(&p))?;
    end_progress();
    print!("{report}");
    if !report.holds() {
        bail!("the demo saw a wrong outcome");
    }
    Ok(())
}
