//! `dedupd rabbitmq-bench`: the RabbitMQ source against a consume-only baseline, same run,
//! on a real server.
//!
//! Each phase has a fresh durable queue of its own, filled first with the same generated
//! OrderPlaced events (fixed seed, `dup_rate` redeliveries; `message_id` = event id,
//! header `order-id`; persistent, publisher confirms), then consumed to the end with the
//! same `prefetch`:
//!
//! 1. consume-only: a plain lapin consumer, one `multiple` ack per batch of deliveries, no
//!    processing;
//! 2. the engine without a handler: the source, claims only (dedup, durable commit, ack);
//! 3. the engine with `--handler` (when given), state per order.
//!
//! Each is timed from the first delivery to the last acknowledgement. The queues are
//! deleted afterwards.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::Serialize;

use super::{BindingConfig, RabbitMqConfig, RabbitMqError, RabbitMqStats};
use crate::bench::params::{self, ParamError};
use crate::config::{Config, PartitionSource, SubscriberConfig};
use crate::source::bench_common::{self, SetupError};
use crate::source::generator::Event;

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct RabbitBenchParams {
    pub uri: String,
    pub messages: u64,
    pub dup_rate: f64,
    pub seed: u64,
    pub prefetch: u16,
    pub handler: Option<PathBuf>,
    /// Shards (default: number of cores).
    pub shards: Option<usize>,
    /// Directory for the temporary data directory.
    pub dir: PathBuf,
}

impl RabbitBenchParams {
    /// Refuses parameters the run cannot use: `dup_rate` in [0, 1), `messages` and
    /// `prefetch` at least 1, a `handler` that exists. [`run`] calls it first.
    pub fn validate(&self) -> Result<(), ParamError> {
        params::fraction("dup_rate", self.dup_rate)?;
        params::at_least_one("messages", self.messages)?;
        params::at_least_one("prefetch", self.prefetch)?;
        params::handler_built(self.handler.as_deref())
    }
}

/// The figures.
#[derive(Debug, Clone, Serialize)]
pub struct RabbitBenchReport {
    pub(crate) params: RabbitBenchParams,
    pub(crate) publish_msgs_per_sec: f64,
    pub(crate) consume_only_msgs_per_sec: f64,
    pub(crate) engine_msgs_per_sec: f64,
    /// Engine / consume-only.
    pub(crate) engine_ratio: f64,
    pub(crate) handler_msgs_per_sec: Option<f64>,
    pub(crate) handler_ratio: Option<f64>,
    /// Messages acknowledged per `basic.ack` frame by the engine (each frame is work for
    /// the server), without and with the handler.
    pub(crate) engine_acks_per_frame: f64,
    pub(crate) handler_acks_per_frame: Option<f64>,
}

impl std::fmt::Display for RabbitBenchParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rabbitmq-bench: {} messages (dup rate {}, seed {}), prefetch {}, handler {}, server {}",
            self.messages,
            self.dup_rate,
            self.seed,
            self.prefetch,
            self.handler
                .as_ref()
                .map_or("none".into(), |h| h.display().to_string()),
            super::redacted(&self.uri)
        )
    }
}

impl std::fmt::Display for RabbitBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "publish (confirms)    {:>10.0} msgs/s",
            self.publish_msgs_per_sec
        )?;
        bench_common::write_rates(
            f,
            self.consume_only_msgs_per_sec,
            (self.engine_msgs_per_sec, self.engine_ratio),
            self.handler_msgs_per_sec.zip(self.handler_ratio),
        )?;
        write!(
            f,
            "acks per basic.ack    {:>10.1} (engine)",
            self.engine_acks_per_frame
        )?;
        if let Some(h) = self.handler_acks_per_frame {
            write!(f, "  {h:.1} (engine, handler)")?;
        }
        writeln!(f)
    }
}

fn client(e: impl std::fmt::Display) -> RabbitMqError {
    RabbitMqError::Client(e.to_string())
}

/// Runs the phases, after [`RabbitBenchParams::validate`] (its refusal comes as
/// [`RabbitMqError::Config`]); `progress` gets (phase, messages done, total).
pub fn run(
    params: &RabbitBenchParams,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<RabbitBenchReport, RabbitMqError> {
    params
        .validate()
        .map_err(|e| RabbitMqError::Config(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(client)?;
    let (conn, ch) = rt.block_on(async {
        let conn = Connection::connect(&params.uri, ConnectionProperties::default())
            .await
            .map_err(client)?;
        let ch = conn.create_channel().await.map_err(client)?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(client)?;
        Ok::<_, RabbitMqError>((conn, ch))
    })?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let tag = format!("{}-{now}", std::process::id());
    let queues = [
        format!("dedupd-bench-consume-{tag}"),
        format!("dedupd-bench-engine-{tag}"),
        format!("dedupd-bench-handler-{tag}"),
    ];
    let phases = if params.handler.is_some() { 3 } else { 2 };
    let result = (|| {
        let mut publish_s = 0.0;
        for q in &queues[..phases] {
            publish_s += rt.block_on(fill(&ch, q, params, progress))?;
        }
        let publish = (params.messages * phases as u64) as f64 / publish_s;
        let baseline = rt.block_on(consume_only(&conn, &queues[0], params, progress))?;
        let (engine_s, engine_acks) = engine(params, &queues[1], None, progress)?;
        let handler = match &params.handler {
            Some(h) => Some(engine(params, &queues[2], Some(h.clone()), progress)?),
            None => None,
        };
        let rate = |s: f64| params.messages as f64 / s;
        Ok(RabbitBenchReport {
            params: params.clone(),
            publish_msgs_per_sec: publish,
            consume_only_msgs_per_sec: rate(baseline),
            engine_msgs_per_sec: rate(engine_s),
            engine_ratio: baseline / engine_s,
            handler_msgs_per_sec: handler.map(|(h, _)| rate(h)),
            handler_ratio: handler.map(|(h, _)| baseline / h),
            engine_acks_per_frame: engine_acks,
            handler_acks_per_frame: handler.map(|(_, a)| a),
        })
    })();
    rt.block_on(async {
        for q in &queues {
            let _ = ch
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = conn.close(200, "bench done".into()).await;
    });
    result
}

/// Declares `queue` and publishes the generated traffic to it; returns the seconds taken.
async fn fill(
    ch: &Channel,
    queue: &str,
    params: &RabbitBenchParams,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<f64, RabbitMqError> {
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await
    .map_err(client)?;
    let mut traffic = bench_common::traffic(params.seed, params.messages, params.dup_rate);
    let mut ev = Event::default();
    let start = Instant::now();
    let mut confirms = Vec::new();
    let mut n = 0;
    while traffic.next_into(&mut ev) {
        let mut headers = FieldTable::default();
        headers.insert(
            "order-id".into(),
            AMQPValue::LongString(format!("o-{}", ev.order).into()),
        );
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(ev.id.as_str().into())
            .with_headers(headers);
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                &ev.payload,
                props,
            )
            .await
            .map_err(client)?,
        );
        n += 1;
        if confirms.len() >= 5_000 {
            for c in confirms.drain(..) {
                c.await.map_err(client)?;
            }
            progress("publish", n, params.messages);
        }
    }
    for c in confirms {
        c.await.map_err(client)?;
    }
    Ok(start.elapsed().as_secs_f64())
}

/// A plain consumer: every delivery taken, one `multiple` ack per batch of what arrived.
async fn consume_only(
    conn: &Connection,
    queue: &str,
    params: &RabbitBenchParams,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<f64, RabbitMqError> {
    let ch = conn.create_channel().await.map_err(client)?;
    ch.basic_qos(params.prefetch, BasicQosOptions::default())
        .await
        .map_err(client)?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(client)?;
    let mut got = 0u64;
    let mut start = None;
    while got < params.messages {
        let d = consumer
            .next()
            .await
            .ok_or_else(|| client("the consumer ended"))?
            .map_err(client)?;
        start.get_or_insert_with(Instant::now);
        let mut last = d.delivery_tag;
        got += 1;
        while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::ZERO, consumer.next()).await {
            last = d.delivery_tag;
            got += 1;
        }
        ch.basic_ack(last, BasicAckOptions { multiple: true })
            .await
            .map_err(client)?;
        if got % 10_000 < u64::from(params.prefetch) {
            progress("consume-only", got, params.messages);
        }
    }
    let s = start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let _ = ch.close(200, "done".into()).await;
    Ok(s)
}

/// The source over `queue` on a fresh ledger until every message is acknowledged: the
/// seconds taken and the messages acknowledged per `basic.ack` frame.
fn engine(
    params: &RabbitBenchParams,
    queue: &str,
    handler: Option<PathBuf>,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<(f64, f64), RabbitMqError> {
    let phase = if handler.is_some() {
        "engine+handler"
    } else {
        "engine"
    };
    let mut config = Config::default();
    config.ledger.shards = params.shards.and_then(NonZeroUsize::new);
    config.subscribers.push(SubscriberConfig {
        name: "bench".into(),
        // The default key source (`id`) reads `message_id`; state per order.
        partition_key: Some(PartitionSource::Header {
            name: "order-id".into(),
        }),
        handler,
        ..Default::default()
    });
    let (_dir, ledger) = bench_common::fresh_ledger(&params.dir, "dedupd-rabbitmq-bench-", &config)
        .map_err(|e| match e {
            SetupError::Ledger(e) => RabbitMqError::Ledger(e),
            SetupError::Config(e) => RabbitMqError::Config(e),
        })?;
    let mut r = RabbitMqConfig::new(params.uri.clone());
    r.bindings.push(BindingConfig {
        subscriber: "bench".into(),
        queue: queue.into(),
        declare: false,
        dead_letter_queue: None,
        prefetch: std::num::NonZeroU16::new(params.prefetch).unwrap_or(std::num::NonZeroU16::MIN),
    });
    let stats = vec![Arc::new(RabbitMqStats::default())];
    let (source_ledger, s) = (ledger.clone(), &stats[0]);
    let (elapsed, result) = bench_common::run_timed(
        |shutdown| super::run_with(source_ledger, &r, shutdown, &stats),
        &s.received,
        &s.acked,
        params.messages,
        |acked| progress(phase, acked, params.messages),
    );
    result
        .map_err(|_| client("the source thread panicked"))?
        .map(|_| ())?;
    bench_common::close_ledger(ledger).map_err(|e| RabbitMqError::Ledger(e.to_string()))?;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    let per_frame = get(&s.acked) as f64 / get(&s.ack_frames).max(1) as f64;
    Ok((elapsed.as_secs_f64(), per_frame))
}
