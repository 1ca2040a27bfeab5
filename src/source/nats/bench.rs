//! `dedupd nats-bench`: the NATS JetStream source against a consume-only baseline, same
//! run, on a real server.
//!
//! Each phase has a stream of its own (file storage), filled first with the same generated
//! OrderPlaced events (fixed seed, `dup_rate` redeliveries; header `message-id` = event id,
//! four subjects by order), published with JetStream acks in pipelined batches of
//! `PUBLISH_BATCH`. Then each stream is consumed to the end through a durable pull
//! consumer (`AckPolicy::Explicit`) with the same in-flight window (`MaxAckPending`) and
//! pull batch:
//!
//! 1. consume-only: a plain async-nats consumer that acknowledges each message as it
//!    arrives, nothing else;
//! 2. the engine without a handler: the source, claims only (dedup, durable commit, ack);
//! 3. the engine with `--handler` (when given), state per order.
//!
//! Each is timed from the first message to the last acknowledgement sent; afterwards the
//! server's ack floor of the consumer must reach the stream's last message (every message
//! acknowledged), and is reported. The streams are deleted at the end.
//!
//! The key is the `message-id` header, not `Nats-Msg-Id`: JetStream's own duplicate
//! window would drop the redeliveries at publish, and the engine would not see them.

use std::future::IntoFuture;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use serde::Serialize;

use super::{NatsConfig, NatsError, NatsStats};
use crate::bench::params::{self, ParamError};
use crate::config::Config;
use crate::source::bench_common::{self, SetupError};
use crate::source::generator::Event;

/// Publish acks awaited together: the messages of a batch are all in flight at once.
pub(crate) const PUBLISH_BATCH: usize = 2048;

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct NatsBenchParams {
    pub server: String,
    pub messages: u64,
    pub dup_rate: f64,
    pub seed: u64,
    /// `MaxAckPending` of every consumer: the in-flight window.
    pub window: usize,
    /// Messages asked for per pull request (at most `window`).
    pub batch: usize,
    pub handler: Option<PathBuf>,
    /// Directory for the temporary data directories.
    pub dir: PathBuf,
}

impl NatsBenchParams {
    /// Refuses parameters the run cannot use: `dup_rate` in [0, 1), `messages` and
    /// `batch` at least 1, `batch` at most `window`, a `handler` that exists. [`run`] calls
    /// it first.
    pub fn validate(&self) -> Result<(), ParamError> {
        params::fraction("dup_rate", self.dup_rate)?;
        params::at_least_one("messages", self.messages)?;
        params::at_least_one("batch", self.batch)?;
        let (batch, window) = (self.batch, self.window);
        params::require(
            batch <= window,
            "batch",
            "at most the window",
            format!("{batch} with window {window}"),
        )?;
        params::handler_built(self.handler.as_deref())
    }
}

/// The figures; what the server counts acknowledged after each phase (the consumer's ack
/// floor: `messages` when every message was); messages a phase received more than once
/// (delivered again after `AckWait`: a message lost on the way costs that much time).
#[derive(Debug, Clone, Serialize)]
pub struct NatsBenchReport {
    pub(crate) params: NatsBenchParams,
    pub(crate) publish_msgs_per_sec: f64,
    pub(crate) consume_only_msgs_per_sec: f64,
    pub(crate) consume_only_acked: u64,
    pub(crate) consume_only_redelivered: u64,
    pub(crate) engine_msgs_per_sec: f64,
    /// Engine / consume-only.
    pub(crate) engine_ratio: f64,
    pub(crate) engine_acked: u64,
    pub(crate) engine_redelivered: u64,
    pub(crate) handler_msgs_per_sec: Option<f64>,
    pub(crate) handler_ratio: Option<f64>,
    pub(crate) handler_acked: Option<u64>,
    pub(crate) handler_redelivered: Option<u64>,
}

impl std::fmt::Display for NatsBenchParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "nats-bench: {} messages (dup rate {}, seed {}), window {}, batch {}, handler {}, server {}",
            self.messages,
            self.dup_rate,
            self.seed,
            self.window,
            self.batch,
            self.handler
                .as_ref()
                .map_or("none".into(), |h| h.display().to_string()),
            self.server
        )
    }
}

impl std::fmt::Display for NatsBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "publish (acks)        {:>10.0} msgs/s",
            self.publish_msgs_per_sec
        )?;
        bench_common::write_rates(
            f,
            self.consume_only_msgs_per_sec,
            (self.engine_msgs_per_sec, self.engine_ratio),
            self.handler_msgs_per_sec.zip(self.handler_ratio),
        )
    }
}

fn client(e: impl std::fmt::Display) -> NatsError {
    NatsError::Client(e.to_string())
}

/// The durable consumer of every phase (one per stream).
const DURABLE: &str = "dedupd-bench";

/// Runs the phases, after [`NatsBenchParams::validate`] (its refusal comes as
/// [`NatsError::Config`]); `progress` gets (phase, messages done, total).
pub fn run(
    params: &NatsBenchParams,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<NatsBenchReport, NatsError> {
    params
        .validate()
        .map_err(|e| NatsError::Config(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(client)?;
    // The source's client options (and its logging of connection events, slow consumer
    // included).
    let js = rt.block_on(async {
        let options = super::connect_options(&NatsConfig::new(vec![params.server.clone()])).await?;
        let c = options
            .connect(params.server.as_str())
            .await
            .map_err(|e| client(format!("cannot connect to {}: {e}", params.server)))?;
        Ok::<_, NatsError>(jetstream::new(c))
    })?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let tag = format!("{}-{now}", std::process::id());
    let phases = if params.handler.is_some() { 3 } else { 2 };
    let streams: Vec<String> = ["consume", "engine", "handler"][..phases]
        .iter()
        .map(|p| format!("dedupd-bench-{p}-{tag}"))
        .collect();
    let result = (|| {
        let msgs = generate(params);
        let mut publish_s = 0.0;
        for s in &streams {
            publish_s += rt.block_on(fill(&js, s, &msgs, progress))?;
        }
        let publish = (params.messages * phases as u64) as f64 / publish_s;
        let (baseline, consume_only_redelivered) =
            rt.block_on(consume_only(&js, &streams[0], params, progress))?;
        let consume_only_acked = rt.block_on(server_acked(&js, &streams[0], params.messages))?;
        let mut engine = |i: usize, handler: Option<&PathBuf>| {
            let (s, redelivered) = engine(params, &streams[i], handler, progress)?;
            let acked = rt.block_on(server_acked(&js, &streams[i], params.messages))?;
            Ok::<_, NatsError>((s, acked, redelivered))
        };
        let (engine_s, engine_acked, engine_redelivered) = engine(1, None)?;
        let handler = match &params.handler {
            Some(h) => Some(engine(2, Some(h))?),
            None => None,
        };
        let rate = |s: f64| params.messages as f64 / s;
        Ok(NatsBenchReport {
            params: params.clone(),
            publish_msgs_per_sec: publish,
            consume_only_msgs_per_sec: rate(baseline),
            consume_only_acked,
            consume_only_redelivered,
            engine_msgs_per_sec: rate(engine_s),
            engine_ratio: baseline / engine_s,
            engine_acked,
            engine_redelivered,
            handler_msgs_per_sec: handler.map(|(s, _, _)| rate(s)),
            handler_ratio: handler.map(|(s, _, _)| baseline / s),
            handler_acked: handler.map(|(_, a, _)| a),
            handler_redelivered: handler.map(|(_, _, r)| r),
        })
    })();
    rt.block_on(async {
        for s in &streams {
            let _ = js.delete_stream(s).await;
        }
    });
    result
}

/// One message to publish: subject suffix (order % 4), payload, message id.
type Published = (u64, bytes::Bytes, String);

/// The generated traffic (fixed seed, redeliveries included), in publishing order.
fn generate(params: &NatsBenchParams) -> Vec<Published> {
    let mut traffic = bench_common::traffic(params.seed, params.messages, params.dup_rate);
    let mut msgs = Vec::new();
    let mut ev = Event::default();
    while traffic.next_into(&mut ev) {
        msgs.push((
            ev.order % 4,
            bytes::Bytes::from(ev.payload.clone()),
            ev.id.clone(),
        ));
    }
    msgs
}

/// Creates the stream `name` (subjects `name.>`) and publishes `msgs` to it, batch after
/// batch, each batch's publish acks awaited together; returns the seconds taken.
async fn fill(
    js: &jetstream::Context,
    name: &str,
    msgs: &[Published],
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<f64, NatsError> {
    js.create_stream(stream::Config {
        name: name.to_string(),
        subjects: vec![format!("{name}.>")],
        ..Default::default()
    })
    .await
    .map_err(|e| client(format!("cannot create stream {name}: {e}")))?;
    let start = Instant::now();
    let mut done = 0;
    for batch in msgs.chunks(PUBLISH_BATCH) {
        let mut acks = Vec::with_capacity(batch.len());
        for (level, payload, id) in batch {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("message-id", id.as_str());
            acks.push(
                js.publish_with_headers(format!("{name}.{level}"), headers, payload.clone())
                    .await
                    .map_err(client)?,
            );
        }
        futures_util::future::try_join_all(acks.into_iter().map(IntoFuture::into_future))
            .await
            .map_err(client)?;
        done += batch.len() as u64;
        progress("publish", done, msgs.len() as u64);
    }
    Ok(start.elapsed().as_secs_f64())
}

/// The durable pull consumer of a phase, with explicit acks and the bench's window.
async fn consumer(
    js: &jetstream::Context,
    stream: &str,
    window: usize,
) -> Result<PullConsumer, NatsError> {
    let s = js.get_stream(stream).await.map_err(client)?;
    s.get_or_create_consumer(
        DURABLE,
        PullConfig {
            durable_name: Some(DURABLE.into()),
            ack_policy: AckPolicy::Explicit,
            max_ack_pending: i64::try_from(window).unwrap_or(i64::MAX),
            ..Default::default()
        },
    )
    .await
    .map_err(client)
}

/// A plain pull consumer: each message acknowledged as it arrives, nothing else. Returns
/// the seconds and the messages received again.
async fn consume_only(
    js: &jetstream::Context,
    stream: &str,
    params: &NatsBenchParams,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<(f64, u64), NatsError> {
    let c = consumer(js, stream, params.window).await?;
    let mut messages = c
        .stream()
        .max_messages_per_batch(params.batch)
        .messages()
        .await
        .map_err(client)?;
    let (mut got, mut redelivered) = (0u64, 0u64);
    let mut start = None;
    while got < params.messages {
        let m = messages
            .next()
            .await
            .ok_or_else(|| client("the pull ended"))?
            .map_err(client)?;
        start.get_or_insert_with(Instant::now);
        if m.info().is_ok_and(|i| i.delivered > 1) {
            redelivered += 1;
        }
        m.ack().await.map_err(client)?;
        got += 1;
        if got % 10_000 == 0 {
            progress("consume-only", got, params.messages);
        }
    }
    let s = start.map_or(0.0, |t| t.elapsed().as_secs_f64());
    js.client().flush().await.map_err(client)?;
    Ok((s, redelivered))
}

/// The consumer's ack floor once it reaches `count` (every message acknowledged; asked
/// for up to 10 s, acks being asynchronous), else an error.
async fn server_acked(js: &jetstream::Context, stream: &str, count: u64) -> Result<u64, NatsError> {
    let s = js.get_stream(stream).await.map_err(client)?;
    let mut c: PullConsumer = s.get_consumer(DURABLE).await.map_err(client)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info = c.info().await.map_err(client)?;
        let acked = info.ack_floor.stream_sequence;
        if (acked >= count && info.num_ack_pending == 0) || Instant::now() >= deadline {
            if acked < count {
                return Err(client(format!(
                    "stream {stream}: the server counts {acked} of {count} messages acknowledged ({} pending ack)",
                    info.num_ack_pending
                )));
            }
            return Ok(acked);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The source over `stream` on a fresh ledger until every message is acknowledged;
/// returns the seconds from its first message to its last ack, and the messages it
/// received again.
fn engine(
    params: &NatsBenchParams,
    stream: &str,
    handler: Option<&PathBuf>,
    progress: &mut dyn FnMut(&str, u64, u64),
) -> Result<(f64, u64), NatsError> {
    let phase = if handler.is_some() {
        "engine+handler"
    } else {
        "engine"
    };
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
[nats]
servers = [{:?}]

[[nats.binding]]
subscriber = "bench"
stream = {stream:?}
durable = {DURABLE:?}
max_ack_pending = {}
batch = {}
"#,
        params.server, params.window, params.batch
    );
    let config = Config::parse(&text).map_err(|e| NatsError::Config(e.to_string()))?;
    let nats: NatsConfig = config
        .nats
        .clone()
        .ok_or_else(|| NatsError::Config("no [nats]".into()))?;
    let (_dir, ledger) = bench_common::fresh_ledger(&params.dir, "dedupd-nats-bench-", &config)
        .map_err(|e| match e {
            SetupError::Ledger(e) => NatsError::Ledger(e),
            SetupError::Config(e) => NatsError::Config(e),
        })?;
    let stats = vec![Arc::new(NatsStats::default())];
    let (source_ledger, s) = (ledger.clone(), &stats[0]);
    let (elapsed, result) = bench_common::run_timed(
        |shutdown| super::run_with(source_ledger, &nats, shutdown, &stats),
        &s.received,
        &s.acked,
        params.messages,
        |acked| progress(phase, acked, params.messages),
    );
    let summary = result.map_err(|_| client("the source thread panicked"))??;
    tracing::debug!(?summary, "nats-bench engine phase");
    if summary.acked < params.messages {
        return Err(client(format!(
            "the source stopped with {} of {} messages acknowledged",
            summary.acked, params.messages
        )));
    }
    bench_common::close_ledger(ledger).map_err(|e| NatsError::Ledger(e.to_string()))?;
    Ok((elapsed.as_secs_f64(), summary.redelivered))
}
