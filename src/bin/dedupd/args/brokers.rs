//! The arguments of the broker benches (`kafka-bench`, `mqtt-bench`, `nats-bench`,
//! `rabbitmq-bench`): each source against a consume-only client of the same broker, same
//! run. The flags every bench shares are `bench.rs`'s; the library checks the parameters.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use dedupd::source::kafka::bench::KafkaBenchParams;
use dedupd::source::mqtt::bench::MqttBenchParams;
use dedupd::source::nats::bench::NatsBenchParams;
use dedupd::source::rabbitmq::bench::RabbitBenchParams;

use super::bench::{RunFlags, ShardFlags, TrafficFlags};

/// `--dir` of the benches with a data directory per phase (without the final period, as
/// clap drops it from doc comments).
const DIRS_HELP: &str = "Directory in which the temporary data directories are created";

/// `dedupd kafka-bench`.
#[derive(Args)]
pub(crate) struct KafkaBenchArgs {
    /// Messages produced to the input topic (redeliveries included).
    #[arg(long, default_value_t = 2_000_000)]
    messages: u64,
    #[command(flatten)]
    traffic: TrafficFlags,
    /// Partitions of the input topic.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Messages of the paced phase that measures end-to-end latency (0 skips it).
    #[arg(long, default_value_t = 200_000)]
    live_messages: u64,
    /// Handler component run for every new message.
    #[arg(long)]
    handler: Option<PathBuf>,
    #[command(flatten)]
    shards: ShardFlags,
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
    #[command(flatten)]
    pub(crate) run: RunFlags,
}

impl KafkaBenchArgs {
    /// The run's parameters, checked by the library.
    pub(crate) fn params(self) -> Result<KafkaBenchParams> {
        let params = KafkaBenchParams {
            messages: self.messages,
            dup_rate: self.traffic.dup_rate,
            seed: self.traffic.seed,
            partitions: self.partitions,
            live_messages: self.live_messages,
            handler: self.handler,
            shards: self.shards.shards,
            dir: self.run.dir,
            brokers: self.brokers,
            changelog: self.changelog,
            ttl: self.ttl,
        };
        params.validate()?;
        Ok(params)
    }
}

/// `dedupd mqtt-bench`.
#[derive(Args)]
#[command(
    mut_arg("seed", |a| a.help("Seed of the generated traffic")),
    mut_arg("dir", |a| a.help(DIRS_HELP))
)]
pub(crate) struct MqttBenchArgs {
    /// The broker (loopback for the figures): its `max_queued_messages` must hold
    /// `--messages` for an offline session.
    #[arg(long, default_value = "mqtt://127.0.0.1:1883")]
    broker: String,
    /// Messages published per phase (redeliveries included). Mosquitto 2.0.11 sends a
    /// queued backlog faster than a client's PUBACKs go out: past ~65,000 the client's
    /// request channel fills (see docs/mqtt.md, "Throughput").
    #[arg(long, default_value_t = 50_000)]
    messages: u64,
    #[command(flatten)]
    traffic: TrafficFlags,
    /// The in-flight window of both consumers (Receive Maximum).
    #[arg(long, default_value_t = 1000)]
    window: u16,
    /// Messages queued for a session at a time: each phase is published and consumed in
    /// rounds of this many (see `--messages`).
    #[arg(long, default_value_t = dedupd::source::mqtt::bench::ROUND)]
    round: usize,
    /// Handler component: a third phase runs it for every new message.
    #[arg(long)]
    handler: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) run: RunFlags,
}

impl MqttBenchArgs {
    /// The run's parameters, checked by the library.
    pub(crate) fn params(self) -> Result<MqttBenchParams> {
        let params = MqttBenchParams {
            broker: self.broker,
            messages: self.messages,
            dup_rate: self.traffic.dup_rate,
            seed: self.traffic.seed,
            window: self.window,
            round: self.round,
            handler: self.handler,
            dir: self.run.dir,
        };
        params.validate()?;
        Ok(params)
    }
}

/// `dedupd rabbitmq-bench`.
#[derive(Args)]
#[command(mut_arg("dir", |a| a.help(DIRS_HELP)))]
pub(crate) struct RabbitmqBenchArgs {
    /// The server (`amqp://host:5672/%2f`); the bench declares and deletes queues of its own.
    #[arg(long, default_value = "amqp://127.0.0.1:5672/%2f")]
    uri: String,
    /// Messages published to each phase's queue (redeliveries included).
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    #[command(flatten)]
    traffic: TrafficFlags,
    /// `basic.qos` prefetch of every consumer.
    #[arg(long, default_value_t = 1024)]
    prefetch: u16,
    /// Handler component for a third phase (the engine with it).
    #[arg(long)]
    handler: Option<PathBuf>,
    #[command(flatten)]
    shards: ShardFlags,
    #[command(flatten)]
    pub(crate) run: RunFlags,
}

impl RabbitmqBenchArgs {
    /// The run's parameters, checked by the library.
    pub(crate) fn params(self) -> Result<RabbitBenchParams> {
        let params = RabbitBenchParams {
            uri: self.uri,
            messages: self.messages,
            dup_rate: self.traffic.dup_rate,
            seed: self.traffic.seed,
            prefetch: self.prefetch,
            handler: self.handler,
            shards: self.shards.shards,
            dir: self.run.dir,
        };
        params.validate()?;
        Ok(params)
    }
}

/// `dedupd nats-bench`.
#[derive(Args)]
#[command(mut_arg("dir", |a| a.help(DIRS_HELP)))]
pub(crate) struct NatsBenchArgs {
    /// The server, with JetStream enabled (`nats-server -js`); the bench creates and
    /// deletes streams of its own.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    server: String,
    /// Messages published to each phase's stream (redeliveries included).
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    #[command(flatten)]
    traffic: TrafficFlags,
    /// `MaxAckPending` of every consumer (the in-flight window; the source's default).
    #[arg(long, default_value_t = 4096)]
    window: usize,
    /// Messages asked for per pull request, at most `--window` (the source's default).
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Handler component for a third phase (the engine with it).
    #[arg(long)]
    handler: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) run: RunFlags,
}

impl NatsBenchArgs {
    /// The run's parameters, checked by the library.
    pub(crate) fn params(self) -> Result<NatsBenchParams> {
        let params = NatsBenchParams {
            server: self.server,
            messages: self.messages,
            dup_rate: self.traffic.dup_rate,
            seed: self.traffic.seed,
            window: self.window,
            batch: self.batch,
            handler: self.handler,
            dir: self.run.dir,
        };
        params.validate()?;
        Ok(params)
    }
}
