//! One session (a connection's life) and its bindings: one channel and one consumer per
//! queue, feeding one subscriber.
//!
//! Acknowledgement (G1): consumers use manual acknowledgements (`no_ack` off). A message
//! is settled only after the shard's `Done` for it says its outcome is durable:
//! `processed`, `duplicate` and `quarantined` are acknowledged — one `basic.ack` with
//! `multiple` for the run of durable messages at the front of the channel's unsettled
//! ones (every earlier delivery tag is settled then, so `multiple` covers nothing that
//! is not durable). A durable message behind one still in flight waits to join that run
//! (the other shard's commit is usually a batch away), and is acknowledged alone only
//! when it waited [`ACK_HOLD`], when half of the window is held, or at a stop: each ack
//! is a frame the server writes, and acknowledging every such message alone made the
//! claims-only engine slower than the handler path; `dead_lettered` and `rejected` (kept in the ledger's dead letters) get
//! `basic.reject` without requeue, so the queue's dead-letter exchange receives them;
//! input that cannot be keyed is kept as a dead-letter record first, then rejected the
//! same way. A crash, a lost connection or a closed channel before an ack leaves the
//! message with the server, which requeues it and delivers it again with `redelivered`
//! set; the ledger answers `duplicate`.
//!
//! Backpressure: `basic.qos` `prefetch` bounds the messages the server sends before
//! acknowledgements, so at most that many are held per binding; the server keeps the
//! rest in the queue.
//!
//! Stop: the consumer is cancelled (no new deliveries); in-flight messages are
//! acknowledged as their outcomes become durable, up to `rabbitmq.drain_timeout`; what is
//! left is given back with `basic.nack` and requeue (delivered again, a `duplicate` if it
//! was durable after all), and the channel is closed.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    BasicRejectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, Consumer};
use tokio::sync::{mpsc, watch};

use super::acks::{held_until, plan_acks, Pending, ACK_HOLD};
use super::{BindingConfig, Ended, RabbitMqConfig, RabbitMqError, RabbitMqStats};
use crate::ledger::{Done, Job, Ledger, Origin, Subscriber};
use crate::pipeline::Shutdown;
use crate::source::delivery::{
    route_or_return, Delivery, Keying, Payload, Routed, Target, Unrouted,
};
use crate::source::settle::{
    bridge_dones, keep_dead_letter, now_ms, submit_staged, Meter, OutcomeMeters, Settle,
};
use crate::telemetry::metric;

/// How often the queue's ready count is read for the metrics.
const QUEUE_INTERVAL: Duration = Duration::from_secs(5);
/// A job's seq is `session << TAG_BITS | delivery tag`: an outcome that arrives after its
/// session ended is counted but not acknowledged (the server requeued that delivery).
const TAG_BITS: u32 = 40;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;

/// Where the shards send a binding's outcomes, kept across sessions so that outcomes
/// decided after their session ended are still counted.
pub(crate) struct Outcomes {
    tx: crossbeam_channel::Sender<Vec<Done>>,
    rx: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Vec<Done>>>>,
}

impl Outcomes {
    pub(crate) fn new(subscriber: &str) -> Outcomes {
        let (tx, rx) = bridge_dones(format!("dedupd-amqp-acks-{subscriber}"));
        Outcomes {
            tx,
            rx: Arc::new(tokio::sync::Mutex::new(rx)),
        }
    }
}

/// Why a binding stopped consuming before a stop.
enum Halt {
    /// The channel or the connection is gone; the session ends and a new one starts.
    Lost(String),
    /// The ledger failed or the server refused the queue: the source stops.
    Failed(RabbitMqError),
}

impl From<RabbitMqError> for Halt {
    fn from(e: RabbitMqError) -> Halt {
        Halt::Failed(e)
    }
}

/// A client error on `what`: fatal while the connection stands (the server refused the
/// operation: a missing queue, other arguments, no permission), else the session is lost.
fn classify(conn: &Connection, what: &str, e: lapin::Error) -> Halt {
    if conn.status().connected() {
        Halt::Failed(RabbitMqError::Client(format!("{what}: {e}")))
    } else {
        Halt::Lost(format!("{what}: {e}"))
    }
}

/// How messages were settled with the server (the `kind` label of the acked metric).
#[derive(Debug, Clone, Copy)]
enum Settled {
    Ack,
    Reject,
    Nack,
}

/// A binding's metric counters, each looked up once a session (see [`Meter`]).
#[derive(Default)]
struct Meters {
    received: Meter,
    redelivered: Meter,
    ack: Meter,
    reject: Meter,
    nack: Meter,
    outcomes: OutcomeMeters,
}

/// The state of one binding in one session.
struct Binding {
    ledger: Arc<Ledger>,
    sub: Arc<Subscriber>,
    config: BindingConfig,
    stats: Arc<RabbitMqStats>,
    meters: Meters,
    channel: Channel,
    consumer_tag: String,
    origin: Origin,
    ack_tx: crossbeam_channel::Sender<Vec<Done>>,
    /// This session's number (the high bits of its jobs' seqs).
    session: u64,
    /// Unsettled deliveries of this session by delivery tag.
    pending: BTreeMap<u64, Pending>,
    /// The binding's `prefetch`: the most unsettled deliveries it holds.
    window: usize,
    /// Since when durable messages wait behind one still in flight, if any do.
    held_since: Option<Instant>,
    staged: Vec<Vec<Job>>,
}

/// Runs the bindings of one connection until `shutdown` triggers (they drain), the
/// connection or a channel is lost, or one fails.
#[allow(
    clippy::too_many_arguments,
    reason = "the parts of one run, passed once"
)]
pub(crate) async fn run_session(
    conn: &Connection,
    session: u64,
    ledger: &Arc<Ledger>,
    r: &RabbitMqConfig,
    shutdown: &Shutdown,
    stats: &[Arc<RabbitMqStats>],
    outcomes: &[Outcomes],
) -> Result<Ended, RabbitMqError> {
    let (lost_tx, lost_rx) = watch::channel::<Option<String>>(None);
    let mut tasks = Vec::new();
    for ((config, st), out) in r.bindings.iter().zip(stats).zip(outcomes) {
        let opened = open(conn, session, ledger, config, st, out.tx.clone()).await;
        let (b, consumer) = match opened {
            Ok(opened) => opened,
            Err(Halt::Lost(reason)) => {
                lost_tx.send_replace(Some(reason.clone()));
                return Ok(Ended::Lost(reason));
            }
            Err(Halt::Failed(e)) => {
                lost_tx.send_replace(Some(e.to_string()));
                return Err(e);
            }
        };
        let (shutdown, lost_tx, lost_rx) = (shutdown.clone(), lost_tx.clone(), lost_rx.clone());
        let drain_timeout = r.drain_timeout;
        let done_rx = out.rx.clone();
        tasks.push(tokio::spawn(async move {
            // Free: the previous session's tasks have all ended.
            let mut done_rx = done_rx.lock_owned().await;
            let ended = consume(b, consumer, &mut done_rx, &shutdown, lost_rx, drain_timeout).await;
            match &ended {
                Err(e) => {
                    lost_tx.send_replace(Some(e.to_string()));
                }
                Ok(Ended::Lost(reason)) => {
                    lost_tx.send_if_modified(|r| {
                        r.get_or_insert_with(|| reason.clone());
                        true
                    });
                }
                Ok(Ended::Stopped) => {}
            }
            ended
        }));
    }
    let mut result = Ok(Ended::Stopped);
    for t in tasks {
        let ended = t
            .await
            .unwrap_or_else(|e| Err(RabbitMqError::Client(format!("binding task failed: {e}"))));
        result = match (result, ended) {
            (Err(e), _) | (_, Err(e)) => Err(e),
            (Ok(Ended::Lost(r)), _) | (_, Ok(Ended::Lost(r))) => Ok(Ended::Lost(r)),
            _ => Ok(Ended::Stopped),
        };
    }
    result
}

/// Opens the binding's channel: prefetch, the queue (declared or checked), the consumer.
async fn open(
    conn: &Connection,
    session: u64,
    ledger: &Arc<Ledger>,
    config: &BindingConfig,
    stats: &Arc<RabbitMqStats>,
    ack_tx: crossbeam_channel::Sender<Vec<Done>>,
) -> Result<(Binding, Consumer), Halt> {
    let sub = ledger
        .subscriber(&config.subscriber)
        .map_err(|e| RabbitMqError::Ledger(e.to_string()))?;
    let channel = conn
        .create_channel()
        .await
        .map_err(|e| classify(conn, "open a channel", e))?;
    channel
        .basic_qos(config.prefetch.get(), BasicQosOptions::default())
        .await
        .map_err(|e| classify(conn, "basic.qos", e))?;
    declare(conn, &channel, config).await?;
    let consumer = channel
        .basic_consume(
            config.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| classify(conn, &format!("consume queue {:?}", config.queue), e))?;
    let consumer_tag = consumer.tag().to_string();
    tracing::info!(subscriber = %sub.name, queue = %config.queue, prefetch = config.prefetch.get(), "rabbitmq consumer started");
    let b = Binding {
        staged: (0..ledger.shard_count()).map(|_| Vec::new()).collect(),
        ledger: ledger.clone(),
        sub,
        origin: Origin::from(format!("rabbitmq:{}", config.queue)),
        config: config.clone(),
        stats: stats.clone(),
        meters: Meters::default(),
        channel,
        consumer_tag,
        ack_tx,
        session,
        pending: BTreeMap::new(),
        window: usize::from(config.prefetch.get()),
        held_since: None,
    };
    Ok((b, consumer))
}

/// Declares the queue (and its dead-letter queue) when configured so, else checks that it
/// exists with a passive declare.
async fn declare(conn: &Connection, channel: &Channel, config: &BindingConfig) -> Result<(), Halt> {
    let what = |q: &str| format!("declare queue {q:?}");
    if !config.declare {
        channel
            .queue_declare(
                config.queue.as_str().into(),
                QueueDeclareOptions::default().passive(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                classify(
                    conn,
                    &format!("queue {:?} (declare = false: it must exist)", config.queue),
                    e,
                )
            })?;
        return Ok(());
    }
    let mut args = FieldTable::default();
    if let Some(dlq) = &config.dead_letter_queue {
        channel
            .queue_declare(
                dlq.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| classify(conn, &what(dlq), e))?;
        // Through the default exchange, whose routing key is the queue's name.
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(dlq.as_str().into()),
        );
    }
    channel
        .queue_declare(config.queue.as_str().into(), QueueDeclareOptions::durable(), args)
        .await
        .map_err(|e| {
            classify(
                conn,
                &format!(
                    "{} (a queue that exists must have the same arguments; declare = false uses it as it is)",
                    what(&config.queue)
                ),
                e,
            )
        })?;
    Ok(())
}

/// Consumes until `shutdown` (then drains), a lost channel or connection (this binding's
/// or, through `lost`, another's), or a failure.
async fn consume(
    mut b: Binding,
    mut consumer: Consumer,
    done_rx: &mut mpsc::UnboundedReceiver<Vec<Done>>,
    shutdown: &Shutdown,
    mut lost: watch::Receiver<Option<String>>,
    drain_timeout: Duration,
) -> Result<Ended, RabbitMqError> {
    let window = b.window;
    let mut queue_tick = tokio::time::interval(QUEUE_INTERVAL);
    let mut last_log = Instant::now();
    let halt = loop {
        let step: Result<(), Halt> = tokio::select! {
            biased;
            () = shutdown.triggered() => break None,
            changed = lost.changed() => match (changed, lost.borrow().clone()) {
                (Ok(()), Some(reason)) => break Some(Halt::Lost(reason)),
                (Err(_), _) => break Some(Halt::Lost("the session ended".into())),
                _ => Ok(()),
            },
            dones = done_rx.recv() => match dones {
                Some(dones) => b.on_done(dones).await,
                None => Err(Halt::Failed(RabbitMqError::Ledger("the ledger stopped answering".into()))),
            },
            d = consumer.next(), if b.pending.len() < window => match d {
                Some(Ok(d)) => b.take(d, &mut consumer, window).await,
                Some(Err(e)) => Err(Halt::Lost(format!("queue {:?}: {e}", b.config.queue))),
                None => Err(Halt::Lost(format!("the server cancelled the consumer of queue {:?}", b.config.queue))),
            },
            () = held_until(b.held_since), if b.held_since.is_some() => b.ack_durable(true).await,
            _ = queue_tick.tick() => b.report_queue().await,
        };
        if let Err(h) = step {
            break Some(h);
        }
        if last_log.elapsed() >= Duration::from_secs(1) {
            last_log = Instant::now();
            b.log_progress("rabbitmq progress");
        }
    };
    match halt {
        None => {
            b.drain(done_rx, drain_timeout).await?;
            b.log_progress("rabbitmq consumer stopped");
            Ok(Ended::Stopped)
        }
        Some(Halt::Lost(reason)) => {
            // Outcomes still on their way are durable all the same; the server has the
            // messages back and their redeliveries are answered `duplicate`.
            tracing::warn!(subscriber = %b.sub.name, queue = %b.config.queue, unsettled = b.pending.len(), "rabbitmq binding lost: {reason}");
            Ok(Ended::Lost(reason))
        }
        Some(Halt::Failed(e)) => Err(e),
    }
}

fn lost(what: &str, e: lapin::Error) -> Halt {
    Halt::Lost(format!("{what} not sent: {e}"))
}

impl Binding {
    fn counter(&self, name: &'static str) -> metrics::Counter {
        metrics::counter!(name, "subscriber" => self.sub.name.to_string(), "queue" => self.config.queue.clone())
    }

    /// Adds `n` to the counter `name`, kept in `meter` (looked up the first time).
    fn count(&self, meter: &Meter, name: &'static str, n: u64) {
        meter.get(|| self.counter(name)).increment(n);
    }

    /// Accepts `d` and whatever else arrived already, then submits them together.
    async fn take(
        &mut self,
        d: lapin::message::Delivery,
        consumer: &mut Consumer,
        window: usize,
    ) -> Result<(), Halt> {
        self.accept(d).await?;
        while self.pending.len() < window {
            match tokio::time::timeout(Duration::ZERO, consumer.next()).await {
                Ok(Some(Ok(d))) => self.accept(d).await?,
                Ok(Some(Err(e))) => {
                    self.flush()?;
                    return Err(Halt::Lost(format!("queue {:?}: {e}", self.config.queue)));
                }
                _ => break,
            }
        }
        self.flush()?;
        Ok(())
    }

    /// Keys and routes one message; input that cannot be keyed is dead-lettered.
    async fn accept(&mut self, d: lapin::message::Delivery) -> Result<(), Halt> {
        self.stats.received.fetch_add(1, Ordering::Relaxed);
        self.count(&self.meters.received, metric::RABBITMQ_RECEIVED_TOTAL, 1);
        if d.redelivered {
            self.stats.redelivered.fetch_add(1, Ordering::Relaxed);
            self.count(
                &self.meters.redelivered,
                metric::RABBITMQ_REDELIVERED_TOTAL,
                1,
            );
        }
        let tag = d.delivery_tag;
        if tag > TAG_MASK {
            // Not in any real channel's life; a new session starts the tags again.
            return Err(Halt::Lost("delivery tags of the channel exhausted".into()));
        }
        let props = &d.properties;
        let routing_key = Some(d.routing_key.to_string()).filter(|k| !k.is_empty());
        let delivery = Delivery {
            id: props.message_id().as_ref().map(|s| s.as_str().to_string()),
            key: routing_key,
            headers: headers_of(props.headers().as_ref()),
            origin: Some(self.origin.clone()),
            received_at_ms: now_ms(),
            ..Delivery::new(Target::Resolved(self.sub.clone()), Payload::Bytes(d.data))
        };
        // A refused message comes back whole for its dead-letter record: nothing (not the
        // payload either) is copied beforehand for the rare one refused.
        match route_or_return(&self.ledger, delivery, Keying::Derive, self.ack_tx.clone()) {
            Ok(Routed { mut job, shard, .. }) => {
                job.seq = self.session << TAG_BITS | tag;
                self.pending.insert(tag, Pending::InFlight);
                self.staged[shard].push(job);
                Ok(())
            }
            Err(refused) => {
                let (e, back) = *refused;
                self.refuse(back, e.to_string(), tag).await
            }
        }
    }

    /// Unusable input: a durable dead-letter record first, then `basic.reject` without
    /// requeue (G1: never settled before its record is durable).
    async fn refuse(&mut self, d: Unrouted, reason: String, tag: u64) -> Result<(), Halt> {
        tracing::warn!(subscriber = %self.sub.name, queue = %self.config.queue, %reason, "rabbitmq message rejected: kept as a dead letter and rejected to the queue's dead-letter exchange");
        let about = serde_json::json!({
            "origin": self.origin.to_string(),
            "id": d.id,
            "key": d.key,
            "headers": d.headers,
        });
        keep_dead_letter(
            &self.ledger,
            &self.sub.name,
            &self.stats.outcomes,
            reason,
            about,
            &d.payload,
        )
        .await
        .map_err(|e| RabbitMqError::Ledger(e.to_string()))?;
        self.count_outcome("rejected", 1);
        self.reject(tag).await
    }

    fn count_outcome(&self, outcome: &'static str, n: u64) {
        self.meters.outcomes.increment(outcome, n, |outcome| {
            metrics::counter!(metric::RABBITMQ_MESSAGES_TOTAL,
                "subscriber" => self.sub.name.to_string(), "queue" => self.config.queue.clone(), "outcome" => outcome)
        });
    }

    fn count_settled(&self, settled: Settled, n: u64) {
        let (meter, kind) = match settled {
            Settled::Ack => (&self.meters.ack, "ack"),
            Settled::Reject => (&self.meters.reject, "reject"),
            Settled::Nack => (&self.meters.nack, "nack"),
        };
        meter
            .get(|| {
                metrics::counter!(metric::RABBITMQ_ACKED_TOTAL,
                    "subscriber" => self.sub.name.to_string(), "queue" => self.config.queue.clone(), "kind" => kind)
            })
            .increment(n);
    }

    /// Submits the staged jobs to their shards.
    fn flush(&mut self) -> Result<(), RabbitMqError> {
        submit_staged(&self.ledger, &mut self.staged)
            .map_err(|e| RabbitMqError::Ledger(e.to_string()))
    }

    /// Marks each message whose outcome is durable now, rejects the dead-lettered ones and
    /// acknowledges the durable ones.
    async fn on_done(&mut self, dones: Vec<Done>) -> Result<(), Halt> {
        for d in dones {
            let (session, tag) = (d.seq >> TAG_BITS, d.seq & TAG_MASK);
            // An outcome of an earlier session is counted; its delivery is the server's
            // again (requeued when that session ended), its redelivery a duplicate.
            let current = session == self.session && self.pending.contains_key(&tag);
            if session == self.session && !current {
                continue;
            }
            // G7: on a failure nothing more is acknowledged; the server redelivers after a
            // restart.
            let (name, settle) = self
                .stats
                .outcomes
                .count(&d.outcome)
                .map_err(|e| Halt::Failed(RabbitMqError::Ledger(e.to_string())))?;
            self.count_outcome(name, 1);
            if !current {
                continue;
            }
            match settle {
                Settle::Refuse => {
                    self.pending.remove(&tag);
                    self.reject(tag).await?;
                }
                Settle::Ack => {
                    self.pending.insert(tag, Pending::Durable);
                }
            }
        }
        self.ack_durable(false).await
    }

    /// Acknowledges durable messages as [`plan_acks`] says: the run at the front with one
    /// `multiple` ack (no unsettled tag below its last is still in flight), those behind
    /// one in flight alone when `hurry` or the window asks for it.
    async fn ack_durable(&mut self, hurry: bool) -> Result<(), Halt> {
        let hurry = hurry
            || self
                .held_since
                .is_some_and(|since| since.elapsed() >= ACK_HOLD);
        let plan = plan_acks(&self.pending, self.window, hurry);
        if let Some(&last) = plan.front.last() {
            let multiple = plan.front.len() > 1;
            self.channel
                .basic_ack(last, BasicAckOptions { multiple })
                .await
                .map_err(|e| lost("basic.ack", e))?;
            for tag in &plan.front {
                self.pending.remove(tag);
            }
            self.settled_acks(plan.front.len() as u64, 1);
        }
        if !plan.alone.is_empty() {
            let acks = plan.alone.iter().map(|tag| {
                self.channel
                    .basic_ack(*tag, BasicAckOptions { multiple: false })
            });
            for r in futures_util::future::join_all(acks).await {
                r.map_err(|e| lost("basic.ack", e))?;
            }
            for tag in &plan.alone {
                self.pending.remove(tag);
            }
            self.settled_acks(plan.alone.len() as u64, plan.alone.len() as u64);
        }
        self.held_since = match (plan.held, self.held_since) {
            (0, _) => None,
            (_, Some(since)) => Some(since),
            (_, None) => Some(Instant::now()),
        };
        Ok(())
    }

    /// `n` messages acknowledged with `frames` `basic.ack` frames.
    fn settled_acks(&self, n: u64, frames: u64) {
        self.stats.acked.fetch_add(n, Ordering::Relaxed);
        self.stats.ack_frames.fetch_add(frames, Ordering::Relaxed);
        self.count_settled(Settled::Ack, n);
    }

    /// `basic.reject` without requeue: to the queue's dead-letter exchange, if any.
    async fn reject(&self, tag: u64) -> Result<(), Halt> {
        self.channel
            .basic_reject(tag, BasicRejectOptions { requeue: false })
            .await
            .map_err(|e| lost("basic.reject", e))?;
        self.stats
            .dead_letter_rejects
            .fetch_add(1, Ordering::Relaxed);
        self.count_settled(Settled::Reject, 1);
        Ok(())
    }

    /// The queue's ready messages (not yet delivered to any consumer) as a gauge: the lag
    /// the server reports. A passive declare; a queue deleted meanwhile closes the channel
    /// and ends the session.
    ///
    /// Its answer is awaited at most [`super::STOP_REPLY`]: the loop awaits it and notices
    /// nothing else meanwhile, so a server that went silent would otherwise hold the loop,
    /// and a stop, for ever (the heartbeat ends such a session in time).
    async fn report_queue(&self) -> Result<(), Halt> {
        let declare = self.channel.queue_declare(
            self.config.queue.as_str().into(),
            QueueDeclareOptions::default().passive(),
            FieldTable::default(),
        );
        let Ok(answer) = tokio::time::timeout(super::STOP_REPLY, declare).await else {
            tracing::debug!(queue = %self.config.queue, "rabbitmq queue report: no answer within {:?}", super::STOP_REPLY);
            return Ok(());
        };
        let q = answer.map_err(|e| Halt::Lost(format!("queue {:?}: {e}", self.config.queue)))?;
        metrics::gauge!(metric::RABBITMQ_QUEUE_MESSAGES,
            "subscriber" => self.sub.name.to_string(), "queue" => self.config.queue.clone())
        .set(f64::from(q.message_count()));
        Ok(())
    }

    /// Stop: no new deliveries; acknowledges what becomes durable within `timeout`;
    /// requeues the rest; closes the channel (the server requeues what it sent after the
    /// cancel and was never taken).
    async fn drain(
        &mut self,
        done_rx: &mut mpsc::UnboundedReceiver<Vec<Done>>,
        timeout: Duration,
    ) -> Result<(), RabbitMqError> {
        let cancel = self.channel.basic_cancel(
            self.consumer_tag.as_str().into(),
            BasicCancelOptions::default(),
        );
        super::at_stop("basic.cancel", &self.config.queue, cancel).await;
        self.flush()?;
        let deadline = tokio::time::Instant::now() + timeout;
        while self.pending.values().any(|p| *p == Pending::InFlight) {
            match tokio::time::timeout_at(deadline, done_rx.recv()).await {
                Ok(Some(dones)) => match self.on_done(dones).await {
                    Ok(()) => {}
                    Err(Halt::Failed(e)) => return Err(e),
                    Err(Halt::Lost(reason)) => {
                        tracing::warn!(queue = %self.config.queue, "rabbitmq drain cut short ({reason}); the server requeues what was not acknowledged");
                        return Ok(());
                    }
                },
                Ok(None) | Err(_) => break,
            }
        }
        // Durable messages still held behind one that did not finish: acknowledged, not
        // requeued (that would only make them duplicates).
        match self.ack_durable(true).await {
            Ok(()) => {}
            Err(Halt::Failed(e)) => return Err(e),
            Err(Halt::Lost(reason)) => {
                tracing::warn!(queue = %self.config.queue, "rabbitmq drain cut short ({reason}); the server requeues what was not acknowledged");
                return Ok(());
            }
        }
        if !self.pending.is_empty() {
            tracing::error!(subscriber = %self.sub.name, queue = %self.config.queue, left = self.pending.len(), "in-flight rabbitmq messages did not finish within rabbitmq.drain_timeout; requeued to be delivered again");
            let tags: Vec<u64> = std::mem::take(&mut self.pending).into_keys().collect();
            let nacks = tags.iter().map(|tag| {
                self.channel.basic_nack(
                    *tag,
                    BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    },
                )
            });
            let sent = futures_util::future::join_all(nacks)
                .await
                .into_iter()
                .filter(Result::is_ok)
                .count() as u64;
            self.stats.requeued.fetch_add(sent, Ordering::Relaxed);
            self.count_settled(Settled::Nack, sent);
        }
        let close = self.channel.close(200, "dedupd stopped".into());
        super::at_stop("the channel's close", &self.config.queue, close).await;
        Ok(())
    }

    fn log_progress(&self, what: &str) {
        let s = &self.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        tracing::info!(
            subscriber = %self.sub.name,
            queue = %self.config.queue,
            received = get(&s.received),
            acked = get(&s.acked),
            dead_letter_rejects = get(&s.dead_letter_rejects),
            redelivered = get(&s.redelivered),
            processed = get(&s.outcomes.processed),
            duplicate = get(&s.outcomes.duplicate),
            in_flight = self.pending.len(),
            "{what}"
        );
    }
}

/// The `headers` table as (name, value) pairs in name order (the table is sorted), values
/// as text: strings as they are, numbers, booleans and timestamps in decimal; byte
/// arrays, nested tables and arrays are left out (no key source reads them).
fn headers_of(headers: Option<&FieldTable>) -> Vec<(String, String)> {
    let Some(h) = headers else {
        return Vec::new();
    };
    h.inner()
        .iter()
        .filter_map(|(name, v)| {
            let text = match v {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                AMQPValue::ShortString(s) => s.as_str().to_string(),
                AMQPValue::Boolean(b) => b.to_string(),
                AMQPValue::ShortShortInt(n) => n.to_string(),
                AMQPValue::ShortShortUInt(n) => n.to_string(),
                AMQPValue::ShortInt(n) => n.to_string(),
                AMQPValue::ShortUInt(n) => n.to_string(),
                AMQPValue::LongInt(n) => n.to_string(),
                AMQPValue::LongUInt(n) => n.to_string(),
                AMQPValue::LongLongInt(n) => n.to_string(),
                AMQPValue::Timestamp(n) => n.to_string(),
                AMQPValue::Float(n) => n.to_string(),
                AMQPValue::Double(n) => n.to_string(),
                _ => return None,
            };
            Some((name.as_str().to_string(), text))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_become_text_and_tables_are_left_out() {
        let mut t = FieldTable::default();
        t.insert("b-id".into(), AMQPValue::LongString("e-1".into()));
        t.insert("a-n".into(), AMQPValue::LongLongInt(-7));
        t.insert("c-ok".into(), AMQPValue::Boolean(true));
        t.insert(
            "d-nested".into(),
            AMQPValue::FieldTable(FieldTable::default()),
        );
        let h = headers_of(Some(&t));
        assert_eq!(
            h,
            vec![
                ("a-n".to_string(), "-7".to_string()),
                ("b-id".to_string(), "e-1".to_string()),
                ("c-ok".to_string(), "true".to_string()),
            ]
        );
        assert!(headers_of(None).is_empty());
    }
}
