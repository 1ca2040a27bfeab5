//! `dedupd mqtt-bench`: the MQTT source against a consume-only baseline, in one run, on a
//! real broker (loopback).
//!
//! Each phase has a persistent session of its own (MQTT 5, `bench/<phase>/#` at QoS 1),
//! given the same generated OrderPlaced events (fixed seed, `dup_rate` redeliveries; user
//! property `message-id` = event id) in rounds of at most [`ROUND`] messages: a round is
//! published while the phase's consumer is offline (the broker queues it), then the
//! consumer connects and is timed from its first message to its last acknowledgement.
//! A phase's rate is its messages over the sum of its rounds' times.
//!
//! 1. Baseline: a plain rumqttc client acknowledges each message as it arrives.
//! 2. Engine: the MQTT source — dedup, durable commit, then PUBACK — on one data
//!    directory for all rounds, stopped after each.
//! 3. With `--handler`: the same with the handler run for every new event.
//!
//! The broker must queue a round for an offline session: mosquitto's
//! `max_queued_messages` at least 50,000 (docs/mqtt.md).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, Event, MqttOptions};
use serde::Serialize;

use super::config::BrokerAddr;
use super::{MqttError, MqttStats};
use crate::bench::params::{self, ParamError};
use crate::config::Config;
use crate::ledger::Ledger;
use crate::source::bench_common::{self, SetupError};
use crate::source::generator::Event as Generated;

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct MqttBenchParams {
    pub broker: String,
    pub messages: u64,
    pub dup_rate: f64,
    pub seed: u64,
    /// The in-flight window of both consumers (Receive Maximum).
    pub window: u16,
    /// Messages queued for a session at a time ([`ROUND`] by default).
    pub round: usize,
    pub handler: Option<PathBuf>,
    /// Directory for the temporary data directories.
    pub dir: PathBuf,
}

impl MqttBenchParams {
    /// Refuses parameters the run cannot use: `dup_rate` in [0, 1), `messages`, `window`
    /// and `round` at least 1, a `handler` that exists. [`run`] calls it first.
    pub fn validate(&self) -> Result<(), ParamError> {
        params::fraction("dup_rate", self.dup_rate)?;
        params::at_least_one("messages", self.messages)?;
        params::at_least_one("window", self.window)?;
        params::at_least_one("round", self.round)?;
        params::handler_built(self.handler.as_deref())
    }
}

/// The figures (messages per second, from the consumer's connection to its last message).
#[derive(Debug, Clone, Serialize)]
pub struct MqttBenchReport {
    pub(crate) params: MqttBenchParams,
    pub(crate) baseline_msgs_per_sec: f64,
    pub(crate) engine_msgs_per_sec: f64,
    pub(crate) engine_ratio: f64,
    pub(crate) handler_msgs_per_sec: Option<f64>,
    pub(crate) handler_ratio: Option<f64>,
}

impl std::fmt::Display for MqttBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "consume-only  {:>10.0} msgs/s",
            self.baseline_msgs_per_sec
        )?;
        writeln!(
            f,
            "engine        {:>10.0} msgs/s ({:.2}x consume-only)",
            self.engine_msgs_per_sec, self.engine_ratio
        )?;
        if let (Some(h), Some(r)) = (self.handler_msgs_per_sec, self.handler_ratio) {
            writeln!(f, "with handler  {h:>10.0} msgs/s ({r:.2}x consume-only)")?;
        }
        Ok(())
    }
}

impl std::fmt::Display for MqttBenchParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mqtt-bench: broker {}, {} messages ({:.0} % redeliveries, seed {}) in rounds of {}, window {}, handler {}",
            self.broker,
            self.messages,
            self.dup_rate * 100.0,
            self.seed,
            self.round,
            self.window,
            self.handler
                .as_ref()
                .map_or("none".into(), |h| h.display().to_string())
        )
    }
}

fn client_error(e: impl std::fmt::Display) -> MqttError {
    MqttError::Client(e.to_string())
}

/// Runs the phases, after [`MqttBenchParams::validate`] (its refusal comes as
/// [`MqttError::Config`]); `progress` hears each phase's name as it starts.
pub fn run(
    params: &MqttBenchParams,
    progress: &mut dyn FnMut(&str),
) -> Result<MqttBenchReport, MqttError> {
    params
        .validate()
        .map_err(|e| MqttError::Config(e.to_string()))?;
    let addr = BrokerAddr::parse(&params.broker).map_err(|e| MqttError::Config(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(client_error)?;
    let tag = std::process::id();
    let msgs = generate(params);
    let rounds: Vec<&[Published]> = msgs.chunks(params.round).collect();
    // Fills the session `id` of `name` with one round's messages while it is offline.
    let fill = |name: &str, i: usize, progress: &mut dyn FnMut(&str)| {
        progress(&format!("{name}: round {}/{}", i + 1, rounds.len()));
        rt.block_on(publish(&addr, rounds[i], &format!("bench/{name}-{tag}")))
    };
    let session = |name: &str| -> Result<String, MqttError> {
        let id = format!("dedupd-bench-{name}-{tag}");
        let filter = format!("bench/{name}-{tag}/#");
        rt.block_on(create_session(&addr, &id, &filter, params.window))?;
        Ok(id)
    };
    let id = session("baseline")?;
    let mut baseline_s = 0.0;
    for (i, round) in rounds.iter().enumerate() {
        fill("baseline", i, progress)?;
        baseline_s += rt.block_on(consume_only(&addr, &id, params.window, round.len()))?;
    }
    let baseline = params.messages as f64 / baseline_s;
    let mut engine = |name: &str, handler: Option<&PathBuf>| -> Result<f64, MqttError> {
        let id = session(name)?;
        let mut engine = Engine::open(params, &id, &format!("bench/{name}-{tag}/#"), handler)?;
        let mut seconds = 0.0;
        for (i, round) in rounds.iter().enumerate() {
            fill(name, i, progress)?;
            seconds += engine.consume(round.len() as u64)?;
        }
        engine.close()?;
        Ok(params.messages as f64 / seconds)
    };
    let engine_rate = engine("engine", None)?;
    let handler = match &params.handler {
        Some(h) => Some(engine("handler", Some(h))?),
        None => None,
    };
    let engine = engine_rate;
    Ok(MqttBenchReport {
        params: params.clone(),
        baseline_msgs_per_sec: baseline,
        engine_msgs_per_sec: engine,
        engine_ratio: engine / baseline,
        handler_msgs_per_sec: handler,
        handler_ratio: handler.map(|h| h / baseline),
    })
}

fn options(addr: &BrokerAddr, id: &str, window: u16) -> MqttOptions {
    let mut o = MqttOptions::new(id, &addr.host, addr.port);
    o.set_clean_start(false)
        .set_session_expiry_interval(Some(3600))
        .set_receive_maximum(Some(window))
        .set_manual_acks(true);
    o
}

async fn create_session(
    addr: &BrokerAddr,
    id: &str,
    filter: &str,
    window: u16,
) -> Result<(), MqttError> {
    let (client, mut events) = AsyncClient::new(options(addr, id, window), 16);
    client
        .subscribe(filter, QoS::AtLeastOnce)
        .await
        .map_err(client_error)?;
    loop {
        if let Event::Incoming(Packet::SubAck(_)) = events.poll().await.map_err(client_error)? {
            break;
        }
    }
    client.disconnect().await.map_err(client_error)?;
    let _ = tokio::time::timeout(Duration::from_secs(1), events.poll()).await;
    Ok(())
}

/// One message to publish: topic level below the phase's prefix, payload, message id.
type Published = (u64, Vec<u8>, String);

/// Messages a session is given at a time: mosquitto 2.0.11 sends a queued backlog to a
/// reconnecting client faster than the client's PUBACKs go out, and past ~65,000 queued
/// the client's request channel (rumqttc, 65,551 requests) fills and acknowledgements are
/// refused (docs/mqtt.md, "Throughput"). Larger runs are several rounds.
pub const ROUND: usize = 50_000;

/// The generated traffic (fixed seed, redeliveries included), in publishing order.
fn generate(params: &MqttBenchParams) -> Vec<Published> {
    let mut traffic = bench_common::traffic(params.seed, params.messages, params.dup_rate);
    let mut msgs = Vec::new();
    let mut ev = Generated::default();
    while traffic.next_into(&mut ev) {
        msgs.push((ev.order % 4, ev.payload.clone(), ev.id.clone()));
    }
    msgs
}

/// Publishes `msgs` under `prefix` at QoS 1 and waits for every PUBACK.
async fn publish(addr: &BrokerAddr, msgs: &[Published], prefix: &str) -> Result<(), MqttError> {
    let id = format!("dedupd-bench-publisher-{}", std::process::id());
    let mut o = MqttOptions::new(id, &addr.host, addr.port);
    o.set_clean_start(true)
        .set_outgoing_inflight_upper_limit(1000);
    let (client, mut events) = AsyncClient::new(o, 1024);
    let n = msgs.len();
    let msgs: Vec<_> = msgs
        .iter()
        .map(|(level, payload, id)| (format!("{prefix}/{level}"), payload.clone(), id.clone()))
        .collect();
    let sender = tokio::spawn(async move {
        for (topic, payload, id) in msgs {
            let props = PublishProperties {
                user_properties: vec![("message-id".into(), id)],
                ..Default::default()
            };
            if client
                .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, props)
                .await
                .is_err()
            {
                break;
            }
        }
        client
    });
    let mut acked = 0;
    while acked < n {
        if let Event::Incoming(Packet::PubAck(_)) = events.poll().await.map_err(client_error)? {
            acked += 1;
        }
    }
    let client = sender.await.map_err(client_error)?;
    client.disconnect().await.map_err(client_error)?;
    let _ = tokio::time::timeout(Duration::from_secs(1), events.poll()).await;
    Ok(())
}

/// Takes over the session and acknowledges every message as it arrives.
async fn consume_only(
    addr: &BrokerAddr,
    id: &str,
    window: u16,
    count: usize,
) -> Result<f64, MqttError> {
    let (client, mut events) =
        AsyncClient::new(options(addr, id, window), usize::from(u16::MAX) + 16);
    let mut start = None;
    let mut got = 0;
    // Acks the client's request channel refused (full: see [`ROUND`]), offered again in
    // order before each poll, as the source does.
    let mut pending = std::collections::VecDeque::new();
    while got < count || !pending.is_empty() {
        while let Some(p) = pending.front() {
            match client.try_ack(p) {
                Ok(()) => pending.pop_front(),
                Err(_) => break,
            };
        }
        if let Event::Incoming(Packet::Publish(p)) = events.poll().await.map_err(client_error)? {
            start.get_or_insert_with(Instant::now);
            got += 1;
            if !pending.is_empty() || client.try_ack(&p).is_err() {
                pending.push_back(p);
            }
        }
    }
    let seconds = start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    client.disconnect().await.map_err(client_error)?;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while events.poll().await.is_ok() {}
    })
    .await;
    Ok(seconds)
}

/// The MQTT source over one session on a fresh data directory, started for each round.
struct Engine {
    ledger: Arc<Ledger>,
    mqtt: super::MqttConfig,
    _dir: tempfile::TempDir,
}

impl Engine {
    fn open(
        params: &MqttBenchParams,
        id: &str,
        filter: &str,
        handler: Option<&PathBuf>,
    ) -> Result<Engine, MqttError> {
        let handler = handler
            .map(|h| format!("handler = {:?}\n", h.display().to_string()))
            .unwrap_or_default();
        let text = format!(
            r#"
[[subscriber]]
name = "bench"
key = {{ source = "header", name = "message-id" }}
partition_key = {{ source = "json_pointer", pointer = "/order_id" }}
{handler}
[mqtt]
broker = "{}"
protocol = "5"
client_id = "{id}"
receive_maximum = {}

[[mqtt.subscription]]
subscriber = "bench"
topics = ["{filter}"]
"#,
            params.broker, params.window
        );
        let config = Config::parse(&text).map_err(|e| MqttError::Config(e.to_string()))?;
        let (dir, ledger) = bench_common::fresh_ledger(&params.dir, "dedupd-mqtt-bench-", &config)
            .map_err(|e| match e {
                SetupError::Ledger(e) => MqttError::Ledger(e),
                SetupError::Config(e) => MqttError::Config(e),
            })?;
        let mqtt = config
            .mqtt
            .clone()
            .ok_or_else(|| MqttError::Config("no [mqtt]".into()))?;
        Ok(Engine {
            ledger,
            mqtt,
            _dir: dir,
        })
    }

    /// Runs the source until `count` messages are acknowledged, then stops it; the
    /// seconds from the first message received to the last PUBACK queued (every message,
    /// redeliveries included, is acknowledged once its outcome is durable), as the
    /// baseline is timed from its first message to its last.
    fn consume(&mut self, count: u64) -> Result<f64, MqttError> {
        let stats = vec![Arc::new(MqttStats::default())];
        let (ledger, mqtt, s) = (self.ledger.clone(), &self.mqtt, &stats[0]);
        let (elapsed, summary) = bench_common::run_timed(
            |shutdown| super::run_with(ledger, mqtt, shutdown, &stats),
            &s.received,
            &s.acked,
            count,
            |_| {},
        );
        let summary = summary.map_err(|_| MqttError::Client("the source panicked".into()))??;
        tracing::debug!(?summary, "mqtt-bench engine round");
        if summary.acked < count {
            return Err(MqttError::Client(format!(
                "the source stopped with {} of {count} messages acknowledged",
                summary.acked
            )));
        }
        Ok(elapsed.as_secs_f64())
    }

    fn close(self) -> Result<(), MqttError> {
        bench_common::close_ledger(self.ledger).map_err(|e| MqttError::Ledger(e.to_string()))
    }
}
