//! `dedupd-bench`: dedupd beside the stores people deduplicate with instead (naive redb,
//! PostgreSQL, Redis, SQLite), in one run on one machine (`compare`, docs/bench-compare.md),
//! and the soak with its plots (`soak`, docs/reliability.md). A crate of its own in the
//! workspace, so the product (`dedupd`) builds without the peers' clients and plotting.
//!
//! `dedupd bench` (the engine alone, with the naive redb baseline) stays in the product.

mod compare;
mod progress;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dedupd::bench::SoakParams;
use dedupd::config::Config;

use compare::CompareParams;

/// The shipping-label component the handler rows run.
const DEFAULT_HANDLER: &str = "plugins/target/wasm32-wasip2/release/shipping_label.wasm";

#[derive(Parser)]
#[command(
    name = "dedupd-bench",
    version,
    about = "dedupd beside PostgreSQL, Redis, SQLite and naive redb; the soak with its plots"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The same workload against dedupd (claim-only and with the shipping-label handler),
    /// naive redb, PostgreSQL, Redis and SQLite, side by side, in one run. PostgreSQL and
    /// Redis are started from their Debian packages on loopback (and stopped afterwards);
    /// a system that cannot start is reported as skipped, with the reason.
    Compare(CompareArgs),
    /// A paced run at a fraction of the measured capacity with a short TTL, so sealing,
    /// merging and expiry run throughout: samples memory, disk, latency, claims and
    /// generations, and judges them (memory and disk bounded, p99 within 2x of the first
    /// minute, compaction keeping up). Exits non-zero when a criterion fails.
    Soak(SoakArgs),
}

fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dedupd-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Compare(args) => compare(args),
        Command::Soak(args) => soak(args),
    }
}

fn compare(args: CompareArgs) -> Result<()> {
    let (json, plots) = (args.json, args.plots.clone());
    let params = args.params()?;
    eprintln!(
        "dedupd-bench compare: {} msgs (per-request peers {}, naive {}), dup rate {}, seed {}, batch {}, {} clients",
        params.messages,
        params.request_messages,
        params.naive_messages,
        params.dup_rate,
        params.seed,
        params.batch,
        params.clients
    );
    let shown = std::cell::RefCell::new(progress::RunProgress::stderr());
    let report = compare::run_compare(
        &params,
        plots.as_deref(),
        |system| shown.borrow_mut().system(system),
        |p| shown.borrow_mut().observe(&p),
    );
    drop(shown);
    match json {
        true => println!("{}", serde_json::to_string(&report)?),
        false => print!("{report}"),
    }
    if !report.verified() {
        bail!("a system's outcomes did not match the generated traffic (rows marked NO)");
    }
    Ok(())
}

fn soak(args: SoakArgs) -> Result<()> {
    let (json, plot) = (args.json, args.plot.clone());
    let params = args.params()?;
    let report = dedupd::bench::run_soak(&params, |line| eprintln!("{line}"))?;
    match json {
        true => println!("{}", serde_json::to_string(&report)?),
        false => print!("{report}"),
    }
    if let Some(path) = plot {
        match compare::plot::draw_soak(&report, &path) {
            Ok(()) => eprintln!("plot: {}", path.display()),
            Err(e) => bail!("{e}"),
        }
    }
    if !report.passed() {
        bail!("the soak failed a criterion (lines marked FAIL)");
    }
    Ok(())
}

/// The config a run uses (`--config`, or the defaults), with `--shards` when given.
fn bench_config(path: Option<&std::path::Path>, shards: Option<usize>) -> Result<Config> {
    let mut config = match path {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    if let Some(n) = shards {
        config.ledger.shards =
            Some(std::num::NonZeroUsize::new(n).context("--shards must be at least 1")?);
    }
    Ok(config)
}

/// `dedupd-bench compare`.
#[derive(Args)]
struct CompareArgs {
    /// Small sizes that finish in about a minute (for CI and a first look).
    #[arg(long)]
    quick: bool,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Write the plots (PNG) into this directory.
    #[arg(long, value_name = "DIR")]
    plots: Option<PathBuf>,
    /// Messages for dedupd and the batched peers [default: 10,000,000; --quick 100,000].
    #[arg(long)]
    messages: Option<u64>,
    /// Messages for the one-request-per-message peers (PostgreSQL per transaction, Redis
    /// unpipelined) [default: 100,000; --quick 5,000].
    #[arg(long)]
    request_messages: Option<u64>,
    /// Messages for the naive redb baseline; 0 skips it [default: 1,000,000; --quick 20,000].
    #[arg(long)]
    naive_messages: Option<u64>,
    /// Keys the naive baseline's table holds before its measured messages, so it is
    /// measured at the size the targets name (loaded without fsync, not timed)
    /// [default: 9,000,000, i.e. 10M keys by the end; --quick 0].
    #[arg(long)]
    naive_stored: Option<u64>,
    /// Fraction of messages that redeliver an earlier message.
    #[arg(long, default_value_t = 0.1)]
    dup_rate: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Messages per statement, pipeline or transaction of the batched peers (and the naive
    /// baseline's commit).
    #[arg(long, default_value_t = 1_000)]
    batch: u64,
    /// Connections of the one-request-per-message peers.
    #[arg(long, default_value_t = 4)]
    clients: u32,
    /// dedupd's most messages in flight.
    #[arg(long, default_value_t = 8_192)]
    window: u64,
    /// The shipping-label component of the handler rows.
    #[arg(long, default_value = DEFAULT_HANDLER)]
    handler: PathBuf,
    /// Directory in which the scratch data directories are created.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// TOML config for dedupd's ledger settings.
    #[arg(long)]
    config: Option<PathBuf>,
    /// dedupd's shards (default: number of cores).
    #[arg(long)]
    shards: Option<usize>,
    /// Messages per point of dedupd's throughput series [default: 1,000,000; --quick 20,000].
    #[arg(long)]
    series_step: Option<u64>,
}

impl CompareArgs {
    fn params(self) -> Result<CompareParams> {
        if !(0.0..1.0).contains(&self.dup_rate) {
            bail!("--dup-rate must be in [0, 1)");
        }
        let pick = |flag: Option<u64>, full: u64, quick: u64| {
            flag.unwrap_or(if self.quick { quick } else { full })
        };
        let messages = pick(self.messages, 10_000_000, 100_000);
        let request_messages = pick(self.request_messages, 100_000, 5_000);
        let series_step = pick(self.series_step, 1_000_000, 20_000);
        if messages == 0 || request_messages == 0 || series_step == 0 || self.batch == 0 {
            bail!("--messages, --request-messages, --series-step and --batch must be at least 1");
        }
        let config = bench_config(self.config.as_deref(), self.shards)?;
        Ok(CompareParams {
            messages,
            request_messages,
            naive_messages: pick(self.naive_messages, 1_000_000, 20_000),
            naive_stored: pick(self.naive_stored, 9_000_000, 0),
            dup_rate: self.dup_rate,
            seed: self.seed,
            batch: self.batch,
            clients: self.clients,
            window: self.window,
            handler: self.handler,
            dir: self.dir,
            series_step,
            config,
        })
    }
}

/// `dedupd-bench soak`.
#[derive(Args)]
struct SoakArgs {
    /// Length of the paced run in minutes (fractions allowed).
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Seconds of the closed-loop capacity measurement before it.
    #[arg(long, default_value_t = 15)]
    capacity_secs: u64,
    /// Fraction of the measured capacity to offer.
    #[arg(long, default_value_t = 0.7)]
    load: f64,
    /// Offer this many messages per second instead of measuring capacity.
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds between samples.
    #[arg(long, default_value_t = 5)]
    sample_secs: u64,
    /// The subscribers' TTL in seconds.
    #[arg(long, default_value_t = 20)]
    ttl_secs: u64,
    /// Claims per active generation before it is sealed.
    #[arg(long, default_value_t = 65_536)]
    generation_claims: usize,
    #[arg(long, default_value_t = 2)]
    subscribers: u32,
    /// Fraction of messages that redeliver an earlier message.
    #[arg(long, default_value_t = 0.1)]
    dup_rate: f64,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Most messages in flight.
    #[arg(long, default_value_t = 65_536)]
    window: u64,
    /// Directory in which the scratch data directories are created.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// TOML config for ledger settings (the soak sets TTL and generation sizes).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Shards (default: number of cores).
    #[arg(long)]
    shards: Option<usize>,
    /// Print one JSON object (with every sample) instead of the table.
    #[arg(long)]
    json: bool,
    /// Draw the curves into this PNG file.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

impl SoakArgs {
    fn params(self) -> Result<SoakParams> {
        if !(self.minutes > 0.0 && self.minutes.is_finite()) {
            bail!("--minutes must be a positive number");
        }
        if !(self.load > 0.0 && self.load <= 1.0) {
            bail!("--load must be in (0, 1]");
        }
        if !(0.0..1.0).contains(&self.dup_rate) {
            bail!("--dup-rate must be in [0, 1)");
        }
        if self.rate.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
            bail!("--rate must be a positive number");
        }
        if self.capacity_secs == 0 || self.sample_secs == 0 || self.ttl_secs == 0 {
            bail!("--capacity-secs, --sample-secs and --ttl-secs must be at least 1");
        }
        let config = bench_config(self.config.as_deref(), self.shards)?;
        Ok(SoakParams {
            duration: std::time::Duration::from_secs_f64(self.minutes * 60.0),
            capacity_duration: std::time::Duration::from_secs(self.capacity_secs),
            load: self.load,
            rate: self.rate,
            sample_every: std::time::Duration::from_secs(self.sample_secs),
            ttl: std::time::Duration::from_secs(self.ttl_secs),
            generation_claims: self.generation_claims,
            subscribers: self.subscribers.max(1),
            dup_rate: self.dup_rate,
            seed: self.seed,
            window: self.window.max(1),
            dir: self.dir,
            config,
        })
    }
}
