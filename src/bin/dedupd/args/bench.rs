//! The benches' arguments: the flags they share (flattened into each), and `dedupd bench`
//! with `bench adversarial`; the broker benches' own flags are in `brokers.rs`. The
//! parameters are checked by the library (each params type's `validate`), so a library
//! caller gets the same refusal.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use dedupd::bench::{AdversarialParams, BenchParams};
use dedupd::config::Config;

/// The generated traffic, as every bench but `bench adversarial` takes it.
#[derive(Args)]
pub(crate) struct TrafficFlags {
    /// Fraction of messages that redeliver an earlier message.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) dup_rate: f64,
    /// Seed of the generated traffic: the same seed gives the same messages.
    #[arg(long, default_value_t = 42)]
    pub(crate) seed: u64,
}

/// Where a bench puts its data and how it prints its report, as every bench but `bench
/// adversarial` takes them.
#[derive(Args)]
pub(crate) struct RunFlags {
    /// Directory in which the temporary data directory is created.
    #[arg(long, default_value = ".")]
    pub(crate) dir: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// `--shards`, of the benches that open a ledger with a shard count of their choosing.
#[derive(Args)]
pub(crate) struct ShardFlags {
    /// Shards (default: number of cores).
    #[arg(long)]
    pub(crate) shards: Option<usize>,
}

impl ShardFlags {
    /// A bench's config: the file (or the defaults) with `--shards` over its shard count.
    fn config(&self, path: Option<&std::path::Path>) -> Result<Config> {
        let mut config = super::load_config(path)?;
        if let Some(n) = self.shards {
            config.ledger.shards =
                Some(std::num::NonZeroUsize::new(n).context("--shards must be at least 1")?);
        }
        Ok(config)
    }
}

/// `dedupd bench`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    pub(crate) command: Option<BenchCommand>,
    /// Messages offered (redeliveries included).
    #[arg(long, default_value_t = 10_000_000)]
    messages: u64,
    #[command(flatten)]
    traffic: TrafficFlags,
    /// Fraction of messages that reuse an id with another payload.
    #[arg(long, default_value_t = 0.0)]
    mismatch_rate: f64,
    /// Subscribers the messages are spread over (round robin).
    #[arg(long, default_value_t = 1)]
    subscribers: u32,
    /// Most messages in flight (handed to the engine, outcome not yet released).
    #[arg(long, default_value_t = 8_192)]
    window: u64,
    /// Messages for the naive baseline (default: same as --messages; 0 skips it).
    #[arg(long)]
    naive_messages: Option<u64>,
    #[command(flatten)]
    shards: ShardFlags,
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
    /// Spread new messages over this many orders, so a handler with state per order reads
    /// and updates existing state (e.g. `--handler …/fixture_counter.wasm --orders
    /// 100000`); default: a new order per new message.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    orders: Option<u64>,
    /// With --handler: the subscribers' partition key, a JSON pointer into the payload
    /// (as the docs recommend for per-order state), or `none` to run each subscriber's
    /// handler on one shard. Ignored when --config sets a partition key.
    #[arg(long, default_value = "/order_id")]
    partition_key: String,
    /// Also print the throughput of every `--series-step` messages, to see whether the
    /// rate holds as claims accumulate (always in `--json`, as `series`).
    #[arg(long)]
    pub(crate) series: bool,
    /// Messages per point of the series.
    #[arg(long, default_value_t = 1_000_000)]
    series_step: u64,
    /// Offer messages at this rate (per second) instead of as fast as the window allows,
    /// to see latency below capacity: run once without it to learn the capacity, then at
    /// half of it. Latency counts from when each message was due, so a run that falls
    /// behind shows the wait (no coordinated omission).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    rate: Option<u64>,
    #[command(flatten)]
    pub(crate) run: RunFlags,
}

impl BenchArgs {
    /// The run's parameters, checked by the library, with `--config` loaded.
    pub(crate) fn params(self) -> Result<BenchParams> {
        let mut params = BenchParams {
            config: Config::default(),
            messages: self.messages,
            dup_rate: self.traffic.dup_rate,
            mismatch_rate: self.mismatch_rate,
            subscribers: self.subscribers,
            seed: self.traffic.seed,
            window: self.window,
            naive_messages: self.naive_messages.unwrap_or(self.messages),
            random_order_ids: self.random_order_ids,
            orders: self.orders,
            series_step: self.series_step,
            rate: self.rate,
            dir: self.run.dir,
            keep: self.keep,
            partition_pointer: (self.partition_key != "none").then_some(self.partition_key),
            handler: self.handler,
        };
        params.validate()?;
        params.config = self.shards.config(self.config.as_deref())?;
        Ok(params)
    }
}

/// The comparison with PostgreSQL, Redis and SQLite and the soak with its plots are the
/// workspace's `dedupd-bench` binary (`cargo run -p dedupd-bench -- compare`), so the
/// product builds without their clients.
#[derive(Subcommand)]
pub(crate) enum BenchCommand {
    /// Fifteen well-behaved handlers next to five hostile ones (trap, endless loop, memory
    /// hog, log flood, sleep in a host call): the good subscribers' throughput with the
    /// hostile ones over without, and exact outcomes, claims and counts for every subscriber.
    Adversarial(AdversarialArgs),
}

/// `dedupd bench adversarial`.
#[derive(Args)]
pub(crate) struct AdversarialArgs {
    /// Messages per well-behaved subscriber (redeliveries included), in each phase.
    #[arg(long, default_value_t = 20_000)]
    messages: u64,
    /// Messages per hostile subscriber.
    #[arg(long, default_value_t = 200)]
    bad_messages: u64,
    /// Well-behaved subscribers.
    #[arg(long, default_value_t = 15)]
    good_subscribers: u32,
    /// Distinct orders (counters) per subscriber.
    #[arg(long, default_value_t = 500)]
    orders: u64,
    /// Every this many messages of a subscriber is a redelivery (0: none).
    #[arg(long, default_value_t = 10)]
    redeliver_every: u64,
    /// Messages in flight per subscriber.
    #[arg(long, default_value_t = 512)]
    window: u64,
    /// Directory holding the fixture components built by plugins/build.sh.
    #[arg(long, default_value = "plugins/target/wasm32-wasip2/release")]
    components: PathBuf,
    /// Directory in which the scratch data directories are created.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// TOML config for ledger settings and subscriber defaults (budget, memory cap,
    /// attempts, backoff).
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(flatten)]
    shards: ShardFlags,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
}

impl AdversarialArgs {
    /// The run's parameters, checked by the library, with `--config` loaded.
    pub(crate) fn params(self) -> Result<AdversarialParams> {
        let mut params = AdversarialParams {
            config: Config::default(),
            good_subscribers: self.good_subscribers,
            messages: self.messages,
            bad_messages: self.bad_messages,
            orders: self.orders,
            redeliver_every: self.redeliver_every,
            window: self.window.max(1),
            components: self.components,
            dir: self.dir,
        };
        params.validate()?;
        params.config = self.shards.config(self.config.as_deref())?;
        Ok(params)
    }
}
