//! The command line's arguments, and their checks before anything runs.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use dedupd::config::Config;

mod bench;
mod brokers;
pub(crate) use bench::{AdversarialArgs, BenchArgs, BenchCommand};
pub(crate) use brokers::{KafkaBenchArgs, MqttBenchArgs, NatsBenchArgs, RabbitmqBenchArgs};

#[derive(Parser)]
#[command(
    name = "dedupd",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("DEDUPD_REVISION"), ")"),
    long_version = dedupd::version_text(),
    about = "Effectively-once consumer engine: durable claims, dedup, quarantine",
    after_long_help = LOG_LEVELS_HELP,
)]
pub(crate) struct Cli {
    /// Log lines on stderr as text or as one JSON object per line (`RUST_LOG` sets the
    /// levels: see `dedupd --help`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Said once, under the main command's `--help`, not under every subcommand's.
const LOG_LEVELS_HELP: &str = "\
Logging:
  `RUST_LOG` sets the levels (e.g. `RUST_LOG=dedupd=debug`); the default is `info` for
  `run` and `serve` (lifecycle events: start, ready, seal, merge, drop, rebalance, stop)
  and `warn` for the other commands. `--log-format json` writes one JSON object per line.

Examples:
  dedupd demo                                   a tour on a temporary data directory
  echo '{\"subscriber\":\"s\",\"id\":\"m-1\",\"payload\":{}}' | dedupd pipe --data-dir data
  dedupd config check dedupd.example.toml       validate a config offline
  dedupd run --config dedupd.toml               the engine (Kafka, HTTP, stdin)
  dedupd inspect --data-dir data                what a stopped engine holds";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// JSON lines on stdin, one durable outcome line per input line on stdout.
    #[command(after_help = "Example:\n  \
        echo '{\"subscriber\":\"orders\",\"id\":\"m-1\",\"payload\":{\"order_id\":\"o-1\"}}' \\\n    \
        | dedupd pipe --data-dir data")]
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
    #[command(after_help = "Examples:\n  dedupd run --config dedupd.toml\n  \
        dedupd run --config dedupd.toml --data-dir /var/lib/dedupd --metrics-bind 127.0.0.1:9187")]
    Run {
        /// TOML config file (see dedupd.example.toml): subscribers, `[kafka]`, `[http]`,
        /// `[metrics]`, ledger settings.
        #[arg(long)]
        config: PathBuf,
        /// Data directory (created on first use); overrides the config's `data_dir`.
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Also serve `/metrics`, `/healthz` and `/readyz` (nothing else) here; the same
        /// as `[metrics] bind` in the config, which it overrides.
        #[arg(long)]
        metrics_bind: Option<std::net::SocketAddr>,
    },
    /// Only the admin and ingest HTTP API, until SIGINT/SIGTERM.
    Serve {
        /// TOML config file; its `[http]` section sets bind address, token and limits.
        #[arg(long)]
        config: Option<PathBuf>,
        /// Data directory (created on first use); overrides the config's `data_dir`.
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
    /// Work with config files.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
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
    Bench(Box<BenchArgs>),
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
    KafkaBench(KafkaBenchArgs),
    /// RabbitMQ source against a consume-only lapin consumer on a real server, same run.
    RabbitmqBench(RabbitmqBenchArgs),
    /// MQTT source against a consume-only client on a real broker, same run.
    MqttBench(MqttBenchArgs),
    /// NATS JetStream source against a consume-only pull consumer on a real server, same run.
    NatsBench(NatsBenchArgs),
    /// The version, the commit it was built from and the data formats it reads (as
    /// `--version`).
    Version,
    /// Shell completions on stdout.
    #[command(
        after_help = "Examples:\n  dedupd completions bash > ~/.local/share/bash-completion/completions/dedupd\n  \
        dedupd completions zsh > \"${fpath[1]}/_dedupd\"\n  \
        dedupd completions fish > ~/.config/fish/completions/dedupd.fish"
    )]
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The manual page (roff) on stdout.
    #[command(after_help = "Example:\n  dedupd man > dedupd.1 && man ./dedupd.1")]
    Man,
    /// Back up a stopped engine's data directory into DIR (new or empty): the shard files,
    /// the manifest, uploaded handlers and the audit log, with backup.json (sizes and
    /// checksums) written last. A running engine is backed up with `POST
    /// /v1/maintenance/backup` instead.
    #[command(after_help = "Example:\n  dedupd backup --data-dir data --to backups/2026-12-06")]
    Backup {
        /// The stopped engine's data directory.
        #[arg(long)]
        data_dir: PathBuf,
        /// Where the backup goes: a new or empty directory.
        #[arg(long, value_name = "DIR")]
        to: PathBuf,
        /// Print the summary as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Verify a backup (backup.json, every file's size and checksum) and copy it into a new
    /// or empty data directory, then open that read-only to confirm it loads. Nothing is
    /// written when the backup does not verify.
    #[command(
        after_help = "Examples:\n  dedupd restore --from backups/2026-12-06 --check\n  \
        dedupd restore --from backups/2026-12-06 --data-dir data"
    )]
    Restore {
        /// The backup directory (as `dedupd backup --to` or the online backup made it).
        #[arg(long, value_name = "DIR")]
        from: PathBuf,
        /// The data directory to restore into: new or empty.
        #[arg(long, required_unless_present = "check")]
        data_dir: Option<PathBuf>,
        /// Only verify the backup; write nothing.
        #[arg(long, conflicts_with = "data_dir")]
        check: bool,
        /// Print the summary as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Per-subscriber counts, generations, state runs, filter sizes and where the disk
    /// bytes go, read from a stopped engine's data directory without writing it.
    #[command(after_help = "Examples:\n  dedupd inspect --data-dir data\n  \
        dedupd inspect --data-dir data --repair --config dedupd.toml --json")]
    Inspect {
        /// The stopped engine's data directory.
        #[arg(long)]
        data_dir: PathBuf,
        /// Open the engine on the directory first (this writes): repairs files a killed
        /// engine left, upgrades an older format, and reports the in-memory index sizes.
        #[arg(long)]
        repair: bool,
        /// With --repair: the config whose subscriber settings the engine opens with.
        #[arg(long, requires = "repair")]
        config: Option<PathBuf>,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum ConfigCommand {
    /// Validate FILE as `dedupd run` would (subscribers, key sources, partition keys,
    /// handler components, `[http]` rules, librdkafka options) and print a summary;
    /// opens no data directory, binds no port and connects nowhere.
    #[command(after_help = "Example:\n  dedupd config check dedupd.example.toml")]
    Check {
        /// The TOML config file to check.
        file: PathBuf,
        /// Print the summary as one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum HandlerCommand {
    /// Validate a component against the WIT contract and the capability allow-list, and
    /// list its imports and exports.
    #[command(after_help = "Example:\n  \
        dedupd handler check plugins/target/wasm32-wasip2/release/shipping_label.wasm")]
    Check {
        /// The component (`.wasm`).
        file: PathBuf,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Run a component over messages (JSON lines, as `dedupd pipe` reads them) exactly as
    /// the engine would, on a temporary ledger, and print per message the outcome, the
    /// state writes, uniqueness marks, versions, emitted messages, guard answers and logs.
    /// Deterministic: `--json > expected.jsonl` makes a file for `--expect`.
    #[command(
        after_help = "Examples:\n  dedupd handler test label.wasm --input messages.jsonl\n  \
        dedupd handler test label.wasm --input messages.jsonl --json > expected.jsonl\n  \
        dedupd handler test label.wasm --input messages.jsonl --expect expected.jsonl"
    )]
    Test(HandlerTestArgs),
    /// Create a standalone handler project DIR/NAME (the SDK and the WIT contract
    /// vendored, a sample handler, sample messages and a README). A Rust project is its
    /// own cargo workspace that builds with `cargo build --release --target
    /// wasm32-wasip2`; a Python one builds with componentize-py (its README says how).
    New {
        /// The handler's name: ASCII letters, digits, '-' and '_', starting with a letter.
        name: String,
        /// The handler's language: `rust` or `python`.
        #[arg(long, default_value = "rust")]
        lang: String,
        /// Where to create the NAME directory.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
}

/// `dedupd handler test`.
#[derive(Args)]
pub(crate) struct HandlerTestArgs {
    /// The component (`.wasm`).
    pub(crate) file: PathBuf,
    /// Messages, one JSON object per line: {"id": ..., "key": ..., "headers": {...},
    /// "payload": ...} (blank lines are skipped).
    #[arg(long)]
    pub(crate) input: PathBuf,
    /// Initial state, JSON lines as `dedupd state dump` prints them ({"key": ...,
    /// "value": ...}), plus {"unique": {"namespace": ..., "key": ...}} and
    /// {"version": {"key": ..., "version": N}}.
    #[arg(long)]
    pub(crate) state: Option<PathBuf>,
    /// One JSON object per message instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// Compare the `--json` output with this file; exit 1 with the first difference.
    #[arg(long)]
    pub(crate) expect: Option<PathBuf>,
    /// Config file whose subscriber settings apply (key source, partition key,
    /// fingerprint, handler limits, attempts); its handler paths are ignored.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// The subscriber of `--config` to run as (default: its `default_subscriber`).
    #[arg(long, requires = "config")]
    pub(crate) subscriber: Option<String>,
    /// Replace the subscriber's `handler_cpu_budget`, e.g. `1s` on a slow CI machine.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) cpu_budget: Option<std::time::Duration>,
    /// The engine's time during the run (ms since the epoch): every message's
    /// received-at.
    #[arg(long, default_value_t = dedupd::harness::DEFAULT_NOW_MS)]
    pub(crate) now_ms: u64,
}

#[derive(Subcommand)]
pub(crate) enum StateCommand {
    /// Print a subscriber's handler state as JSON lines: {"key": ..., "value": ...}.
    #[command(
        after_help = "Example:\n  dedupd state dump --data-dir data --subscriber orders | head"
    )]
    Dump {
        /// The stopped engine's data directory.
        #[arg(long)]
        data_dir: PathBuf,
        /// The subscriber whose state to print.
        #[arg(long)]
        subscriber: String,
        /// The config the engine runs with (its subscriber settings open the directory as
        /// the engine would; without it, the settings stored with the data).
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

pub(crate) const DEFAULT_DEMO_HANDLER: &str =
    "plugins/target/wasm32-wasip2/release/shipping_label.wasm";

/// The config file, or the defaults without one.
pub(crate) fn load_config(path: Option<&std::path::Path>) -> Result<Config> {
    match path {
        Some(p) => Ok(Config::load(p)?),
        None => Ok(Config::default()),
    }
}

/// The data directory: the flag, else the config's `data_dir`.
pub(crate) fn data_dir(flag: Option<PathBuf>, config: &Config) -> Result<PathBuf> {
    match flag.or_else(|| config.data_dir.clone()) {
        Some(d) => Ok(d),
        None => bail!("no data directory: pass --data-dir DIR or set data_dir in the config"),
    }
}

/// `dedupd demo --handler`: a path, or `none` for claims only; the path must exist. The
/// default path is relative to the repository: it is looked for in the current directory
/// and then in the checkout the binary was built in (`target/release/dedupd` is two levels
/// below it), so the demo finds its handler when started from anywhere.
pub(crate) fn demo_handler(handler: &str) -> Result<Option<PathBuf>> {
    if handler == "none" {
        return Ok(None);
    }
    let mut candidates = vec![PathBuf::from(handler)];
    if handler == DEFAULT_DEMO_HANDLER {
        let checkout = std::env::current_exe()
            .ok()
            .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.to_path_buf()));
        candidates.extend(checkout.map(|root| root.join(DEFAULT_DEMO_HANDLER)));
    }
    if let Some(found) = candidates.iter().find(|c| c.is_file()) {
        return Ok(Some(found.clone()));
    }
    let looked: Vec<String> = candidates.iter().map(|c| c.display().to_string()).collect();
    bail!(
        "handler component not found (looked in {}): build it in the repository with \
         `plugins/build.sh -p shipping-label` (scripts/demo does), pass --handler PATH, \
         or --handler none for claims only",
        looked.join(", ")
    );
}

/// `--topic NAME` or `NAME:PARTITIONS` (4 partitions by default).
pub(crate) fn topic(t: &str) -> Result<(&str, i32)> {
    match t.split_once(':') {
        Some((n, p)) => Ok((
            n,
            p.parse::<i32>()
                .with_context(|| format!("--topic {t}: partitions must be a number"))?,
        )),
        None => Ok((t, 4)),
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every flag and argument of every command, with the path of commands leading to it,
    /// that `--help` would list without a word of explanation.
    fn undocumented(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let builtin = matches!(arg.get_id().as_str(), "help" | "version");
            if !arg.is_hide_set() && !builtin && arg.get_help().is_none() {
                out.push(format!("{path} {}", arg.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            if sub.get_about().is_none() && sub.get_name() != "help" {
                out.push(format!("{path} {} (the command)", sub.get_name()));
            }
            undocumented(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn every_flag_and_argument_has_help_text() {
        Cli::command().debug_assert();
        let mut missing = Vec::new();
        undocumented(&Cli::command(), "dedupd", &mut missing);
        assert!(missing.is_empty(), "without help text: {missing:#?}");
    }

    #[test]
    fn the_log_levels_paragraph_is_said_once() {
        let mut cmd = Cli::command();
        let main = cmd.render_long_help().to_string();
        assert!(main.contains("RUST_LOG=dedupd=debug"), "{main}");
        let run = cmd
            .find_subcommand_mut("run")
            .expect("run")
            .render_long_help()
            .to_string();
        assert!(!run.contains("RUST_LOG=dedupd=debug"), "{run}");
        assert!(run.contains("Examples:"), "{run}");
    }
}
