//! The arguments of the broker benches (`kafka-bench`, `mqtt-bench`, `nats-bench`,
//! `rabbitmq-bench`): each source against a consume-only client of the same broker, same
//! run.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;

use dedupd::source::kafka::bench::KafkaBenchParams;
use dedupd::source::mqtt::bench::MqttBenchParams;
use dedupd::source::nats::bench::NatsBenchParams;
use dedupd::source::rabbitmq::bench::RabbitBenchParams;

/// A `--handler` of a bench must exist: the plugins are built separately.
fn handler_built(handler: Option<&PathBuf>) -> Result<()> {
    if let Some(h) = handler {
        if !h.exists() {
            bail!(
                "handler {} not found: build the plugins first (plugins/build.sh)",
                h.display()
            );
        }
    }
    Ok(())
}

/// `dedupd kafka-bench`.
#[derive(Args)]
pub struct KafkaBenchArgs {
    /// Messages produced to the input topic (redeliveries included).
    #[arg(long, default_value_t = 2_000_000)]
    messages: u64,
    /// Fraction of messages that redeliver an earlier message.
    #[arg(long, default_value_t = 0.1)]
    dup_rate: f64,
    /// Seed of the generated traffic: the same seed gives the same messages.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Partitions of the input topic.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Messages of the paced phase that measures end-to-end latency (0 skips it).
    #[arg(long, default_value_t = 200_000)]
    live_messages: u64,
    /// Handler component run for every new message.
    #[arg(long)]
    handler: Option<PathBuf>,
    /// Shards (default: number of cores).
    #[arg(long)]
    shards: Option<usize>,
    /// Directory in which the temporary data directory is created.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Use this cluster instead of the built-in mock broker.
    #[arg(long)]
    brokers: Option<String>,
    /// Publish a changelog (`changelog = true`) and then time restoring it into an empty
    /// data directory.
    #[arg(long)]
    changelog: bool,
    /// Claims expire this long after processing (e.g. `2s`; default: the subscriber
    /// default, 7 days). With `--changelog`, compaction then runs every second with no
    /// grace, so the engine phase pays for tombstoning expired claims (and, with a
    /// `--handler` that writes state, for snapshotting that state first); the restore
    /// phase is skipped (expired claims restore nothing to check).
    #[arg(long, value_parser = humantime::parse_duration)]
    ttl: Option<std::time::Duration>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `dedupd mqtt-bench`.
#[derive(Args)]
pub struct MqttBenchArgs {
    /// The broker (loopback for the figures): its `max_queued_messages` must hold
    /// `--messages` for an offline session.
    #[arg(long, default_value = "mqtt://127.0.0.1:1883")]
    broker: String,
    /// Messages published per phase (redeliveries included). Mosquitto 2.0.11 sends a
    /// queued backlog faster than a client's PUBACKs go out: past ~65,000 the client's
    /// request channel fills (see docs/mqtt.md, "Throughput").
    #[arg(long, default_value_t = 50_000)]
    messages: u64,
    /// Fraction of messages that redeliver an earlier message.
    #[arg(long, default_value_t = 0.1)]
    dup_rate: f64,
    /// Seed of the generated traffic.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// The in-flight window of both consumers (Receive Maximum).
    #[arg(long, default_value_t = 1000)]
    window: u16,
    /// Messages queued for a session at a time: each phase is published and consumed in
    /// rounds of this many (see `--messages`).
    #[arg(long, default_value_t = 50_000)]
    round: usize,
    /// Handler component: a third phase runs it for every new message.
    #[arg(long)]
    handler: Option<PathBuf>,
    /// Directory in which the temporary data directories are created.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl MqttBenchArgs {
    pub fn params(self) -> Result<MqttBenchParams> {
        if !(0.0..1.0).contains(&self.dup_rate)
            || self.messages == 0
            || self.window == 0
            || self.round == 0
        {
            bail!("--dup-rate must be in [0, 1), --messages, --window and --round at least 1");
        }
        handler_built(self.handler.as_ref())?;
        Ok(MqttBenchParams {
            broker: self.broker,
            messages: self.messages,
            dup_rate: self.dup_rate,
            seed: self.seed,
            window: self.window,
            round: self.round,
            handler: self.handler,
            dir: self.dir,
        })
    }
}

impl KafkaBenchArgs {
    pub fn params(self) -> Result<KafkaBenchParams> {
        if !(0.0..1.0).contains(&self.dup_rate) {
            bail!("--dup-rate must be in [0, 1)");
        }
        if self.messages == 0 || self.partitions < 1 {
            bail!("--messages and --partitions must be at least 1");
        }
        handler_built(self.handler.as_ref())?;
        Ok(KafkaBenchParams {
            messages: self.messages,
            dup_rate: self.dup_rate,
            seed: self.seed,
            partitions: self.partitions,
            live_messages: self.live_messages,
            handler: self.handler,
            shards: self.shards,
            dir: self.dir,
            brokers: self.brokers,
            changelog: self.changelog,
            ttl: self.ttl,
        })
    }
}

/// `dedupd rabbitmq-bench`.
#[derive(Args)]
pub struct RabbitmqBenchArgs {
    /// The server (`amqp://host:5672/%2f`); the bench declares and deletes queues of its own.
    #[arg(long, default_value = "amqp://127.0.0.1:5672/%2f")]
    uri: String,
    /// Messages published to each phase's queue (redeliveries included).
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// Fraction of messages that redeliver an earlier message.
    #[arg(long, default_value_t = 0.1)]
    dup_rate: f64,
    /// Seed of the generated traffic: the same seed gives the same messages.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// `basic.qos` prefetch of every consumer.
    #[arg(long, default_value_t = 1024)]
    prefetch: u16,
    /// Handler component for a third phase (the engine with it).
    #[arg(long)]
    handler: Option<PathBuf>,
    /// Shards (default: number of cores).
    #[arg(long)]
    shards: Option<usize>,
    /// Directory in which the temporary data directories are created.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl RabbitmqBenchArgs {
    pub fn params(self) -> Result<RabbitBenchParams> {
        if !(0.0..1.0).contains(&self.dup_rate) {
            bail!("--dup-rate must be in [0, 1)");
        }
        if self.messages == 0 || self.prefetch == 0 {
            bail!("--messages and --prefetch must be at least 1");
        }
        handler_built(self.handler.as_ref())?;
        Ok(RabbitBenchParams {
            uri: self.uri,
            messages: self.messages,
            dup_rate: self.dup_rate,
            seed: self.seed,
            prefetch: self.prefetch,
            handler: self.handler,
            shards: self.shards,
            dir: self.dir,
        })
    }
}

/// `dedupd nats-bench`.
#[derive(Args)]
pub struct NatsBenchArgs {
    /// The server, with JetStream enabled (`nats-server -js`); the bench creates and
    /// deletes streams of its own.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    server: String,
    /// Messages published to each phase's stream (redeliveries included).
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// Fraction of messages that redeliver an earlier message.
    #[arg(long, default_value_t = 0.1)]
    dup_rate: f64,
    /// Seed of the generated traffic: the same seed gives the same messages.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// `MaxAckPending` of every consumer (the in-flight window; the source's default).
    #[arg(long, default_value_t = 4096)]
    window: usize,
    /// Messages asked for per pull request, at most `--window` (the source's default).
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Handler component for a third phase (the engine with it).
    #[arg(long)]
    handler: Option<PathBuf>,
    /// Directory in which the temporary data directories are created.
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl NatsBenchArgs {
    pub fn params(self) -> Result<NatsBenchParams> {
        if !(0.0..1.0).contains(&self.dup_rate) {
            bail!("--dup-rate must be in [0, 1)");
        }
        if self.messages == 0 || self.batch == 0 || self.batch > self.window {
            bail!("--messages and --batch must be at least 1, --batch at most --window");
        }
        handler_built(self.handler.as_ref())?;
        Ok(NatsBenchParams {
            server: self.server,
            messages: self.messages,
            dup_rate: self.dup_rate,
            seed: self.seed,
            window: self.window,
            batch: self.batch,
            handler: self.handler,
            dir: self.dir,
        })
    }
}
