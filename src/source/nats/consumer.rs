//! One binding: a durable pull consumer feeding one subscriber.
//!
//! Acknowledgement (G1): the consumer's `AckPolicy` must be `Explicit` (checked at
//! start: `All` would acknowledge earlier messages whose outcome is not durable yet,
//! `None` would acknowledge on delivery). Each message is acknowledged on its own, after
//! the shard's `Done` for it says its outcome is durable: `processed`, `duplicate` and
//! `quarantined` are `Ack`ed; `dead_lettered` and `rejected` (kept in the ledger's dead
//! letters) are `Term`ed, so the server stops redelivering them and its
//! `MAX_DELIVERIES`/`TERMINATED` advisories see them; input that cannot be keyed is kept
//! as a dead-letter record first, then `Term`ed. A crash before an ack leaves the
//! message with the server, which delivers it again after `AckWait`; the ledger answers
//! `duplicate`.
//!
//! Backpressure: at most `max_ack_pending` messages are held unacknowledged; the consumer
//! stream is not polled while the window is full, and the server's own `MaxAckPending`
//! stops deliveries to every instance sharing the durable consumer.
//!
//! Stop: no new messages are taken; in-flight ones are acknowledged as their outcomes
//! become durable, up to `nats.drain_timeout`; what is left is `Nak`ed with `nak_delay`
//! (delivered again, a `duplicate` if it was durable after all).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull::{Config as PullConfig, Stream as Messages};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::message::Acker;
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use tokio::sync::mpsc;

use super::{BindingConfig, NatsError, NatsStats};
use crate::ledger::{Done, Job, Ledger, Origin, Subscriber};
use crate::pipeline::Shutdown;
use crate::source::delivery::{
    route_or_return, Delivery, Keying, Payload, Routed, Target, Unrouted,
};
use crate::source::settle::{
    bridge_dones, keep_dead_letter, now_ms, submit_staged, Meter, OutcomeMeters, Settle,
};
use crate::telemetry::metric;

/// The header JetStream's own duplicate window reads; an `id` key source reads it too.
pub(crate) const MSG_ID_HEADER: &str = "Nats-Msg-Id";
/// How often the consumer's pending counts are read for the metrics.
const INFO_INTERVAL: Duration = Duration::from_secs(5);
/// How long a stop waits for each thing it asks of the client (the acks of what finished,
/// the gives-back, the flush), and the run loop for the consumer's info, before going on
/// without it. A server that went away leaves the client reconnecting, and until it is
/// back the client takes no more commands once its queue is full and answers no flush or
/// request; whatever was not sent is delivered again and answered `duplicate`.
const SERVER_REPLY: Duration = Duration::from_secs(2);

/// The binding's metric counters, each looked up once (see [`Meter`]).
#[derive(Default)]
struct Meters {
    received: Meter,
    redelivered: Meter,
    ack: Meter,
    term: Meter,
    nak: Meter,
    outcomes: OutcomeMeters,
}

/// The state of one running binding.
struct Binding {
    ledger: Arc<Ledger>,
    sub: Arc<Subscriber>,
    config: BindingConfig,
    stats: Arc<NatsStats>,
    meters: Meters,
    /// The stream's name, shared by every message's origin.
    stream: Arc<str>,
    ack_tx: crossbeam_channel::Sender<Vec<Done>>,
    /// Messages whose outcome is not durable yet, by job seq. Inserted and removed once
    /// per message: foldhash, not SipHash (as the Kafka consumer's partitions).
    in_flight: HashMap<u64, Acker, foldhash::fast::RandomState>,
    next_seq: u64,
    staged: Vec<Vec<Job>>,
    window: usize,
}

/// Consumes one binding until `shutdown` triggers, then drains. An error leaves every
/// message it did not acknowledge with the server (delivered again).
pub(crate) async fn run_binding(
    js: jetstream::Context,
    ledger: Arc<Ledger>,
    config: BindingConfig,
    drain_timeout: Duration,
    stats: Arc<NatsStats>,
    shutdown: Shutdown,
) -> Result<(), NatsError> {
    let sub = ledger
        .subscriber(&config.subscriber)
        .map_err(|e| NatsError::Ledger(e.to_string()))?;
    let mut consumer = open_consumer(&js, &config).await?;
    let server_window = usize::try_from(consumer.cached_info().config.max_ack_pending)
        .ok()
        .filter(|w| *w > 0)
        .unwrap_or(usize::MAX);
    let window = config.max_ack_pending.get().min(server_window);
    let mut messages: Messages = consumer
        .stream()
        .max_messages_per_batch(config.batch.get().min(window))
        .messages()
        .await
        .map_err(|e| NatsError::Client(format!("pull from {:?}: {e}", config.durable)))?;
    let (ack_tx, mut done_rx) = bridge_dones(format!("dedupd-nats-acks-{}", sub.name));
    tracing::info!(subscriber = %sub.name, stream = %config.stream, durable = %config.durable, window, "nats consumer started");
    let mut b = Binding {
        staged: (0..ledger.shard_count()).map(|_| Vec::new()).collect(),
        ledger,
        sub,
        stream: config.stream.as_str().into(),
        config,
        stats,
        meters: Meters::default(),
        ack_tx,
        in_flight: HashMap::default(),
        next_seq: 0,
        window,
    };
    let mut info_tick = tokio::time::interval(INFO_INTERVAL);
    let mut last_log = Instant::now();
    loop {
        tokio::select! {
            biased;
            () = shutdown.triggered() => break,
            dones = done_rx.recv() => match dones {
                Some(dones) => b.on_done(dones).await?,
                None => return Err(NatsError::Ledger("the ledger stopped answering".into())),
            },
            m = messages.next(), if b.in_flight.len() < b.window => match m {
                Some(Ok(m)) => {
                    b.accept(m).await?;
                    // Whatever else arrived already joins the same submission.
                    while b.in_flight.len() < b.window {
                        match tokio::time::timeout(Duration::ZERO, messages.next()).await {
                            Ok(Some(Ok(m))) => b.accept(m).await?,
                            Ok(Some(Err(e))) => { b.pull_error(&e)?; break; }
                            _ => break,
                        }
                    }
                    b.flush()?;
                }
                Some(Err(e)) => b.pull_error(&e)?,
                None => return Err(NatsError::Client(format!("the pull of {:?} ended", b.config.durable))),
            },
            _ = info_tick.tick() => b.report_pending(&mut consumer).await,
        }
        if last_log.elapsed() >= Duration::from_secs(1) {
            last_log = Instant::now();
            b.log_progress("nats progress");
        }
    }
    // No new pulls; buffered, unaccepted messages return to the server after AckWait.
    drop(messages);
    b.drain(&mut done_rx, drain_timeout).await?;
    js_flush(&js).await;
    b.log_progress("nats consumer stopped");
    Ok(())
}

/// Sends the acknowledgements still buffered in the client.
async fn js_flush(js: &jetstream::Context) {
    match tokio::time::timeout(SERVER_REPLY, js.client().flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(
            "nats flush at stop failed (unsent acks mean redeliveries, answered duplicate): {e}"
        ),
        Err(_) => tracing::warn!(
            "nats flush at stop not done within {SERVER_REPLY:?} (the client is not connected); stopping without it: unsent acks mean redeliveries, answered duplicate"
        ),
    }
}

/// The durable consumer, created when configured so; refused unless acks are explicit.
async fn open_consumer(
    js: &jetstream::Context,
    config: &BindingConfig,
) -> Result<PullConsumer, NatsError> {
    let stream = js
        .get_stream(&config.stream)
        .await
        .map_err(|e| NatsError::Client(format!("stream {:?}: {e}", config.stream)))?;
    let consumer: PullConsumer = if config.create {
        let wanted = PullConfig {
            durable_name: Some(config.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_ack_pending: i64::try_from(config.max_ack_pending.get()).unwrap_or(i64::MAX),
            filter_subject: config.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        };
        stream
            .get_or_create_consumer(&config.durable, wanted)
            .await
            .map_err(|e| NatsError::Client(format!("consumer {:?}: {e}", config.durable)))?
    } else {
        stream
            .get_consumer(&config.durable)
            .await
            .map_err(|e| NatsError::Client(format!("consumer {:?}: {e}", config.durable)))?
    };
    let policy = consumer.cached_info().config.ack_policy;
    if policy != AckPolicy::Explicit {
        return Err(NatsError::Config(format!(
            "durable consumer {:?} of stream {:?} has ack policy {policy:?}; dedupd acknowledges each message after its outcome is durable and needs AckPolicy::Explicit (`all` would acknowledge messages still in flight, `none` acknowledges on delivery)",
            config.durable, config.stream
        )));
    }
    Ok(consumer)
}

impl Binding {
    fn counter(&self, name: &'static str) -> metrics::Counter {
        metrics::counter!(name, "subscriber" => self.sub.name.to_string())
    }

    /// Keys and routes one message; input that cannot be keyed is dead-lettered.
    async fn accept(&mut self, m: jetstream::Message) -> Result<(), NatsError> {
        self.stats.received.fetch_add(1, Ordering::Relaxed);
        self.meters
            .received
            .get(|| self.counter(metric::NATS_RECEIVED_TOTAL))
            .increment(1);
        let (delivered, stream_seq) = m
            .info()
            .map(|i| (i.delivered, i.stream_sequence))
            .unwrap_or((1, 0));
        if delivered > 1 {
            self.stats.redelivered.fetch_add(1, Ordering::Relaxed);
            self.meters
                .redelivered
                .get(|| self.counter(metric::NATS_REDELIVERED_TOTAL))
                .increment(1);
        }
        let (msg, acker) = m.split();
        let delivery = Delivery {
            id: msg
                .headers
                .as_ref()
                .and_then(|h| h.get(MSG_ID_HEADER))
                .map(|v| v.as_str().to_string()),
            key: Some(msg.subject.to_string()),
            headers: headers_of(msg.headers.as_ref()),
            origin: Some(Origin::Nats {
                stream: self.stream.clone(),
                sequence: stream_seq,
            }),
            received_at_ms: now_ms(),
            ..Delivery::new(
                Target::Resolved(self.sub.clone()),
                Payload::Bytes(msg.payload.to_vec()),
            )
        };
        // A refused message comes back whole for its dead-letter record: nothing is copied
        // beforehand for the rare one refused.
        match route_or_return(&self.ledger, delivery, Keying::Derive, self.ack_tx.clone()) {
            Ok(Routed { mut job, shard, .. }) => {
                let seq = self.next_seq;
                self.next_seq += 1;
                job.seq = seq;
                self.in_flight.insert(seq, acker);
                self.staged[shard].push(job);
                Ok(())
            }
            Err(refused) => {
                let (e, back) = *refused;
                self.reject(back, e.to_string(), acker).await
            }
        }
    }

    /// Unusable input: a durable dead-letter record first, then `Term` (G1: never an ack
    /// for a message whose record is not durable).
    async fn reject(&mut self, d: Unrouted, reason: String, acker: Acker) -> Result<(), NatsError> {
        tracing::warn!(subscriber = %self.sub.name, %reason, "nats message rejected: kept as a dead letter and terminated");
        let about = serde_json::json!({
            "origin": d.origin.map(|o| o.to_string()),
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
        .map_err(|e| NatsError::Ledger(e.to_string()))?;
        self.count_outcome("rejected", 1);
        self.terminate(&acker).await;
        Ok(())
    }

    fn count_outcome(&self, outcome: &'static str, n: u64) {
        self.meters.outcomes.increment(outcome, n, |outcome| {
            metrics::counter!(metric::NATS_MESSAGES_TOTAL,
                "subscriber" => self.sub.name.to_string(), "outcome" => outcome)
        });
    }

    /// Submits the staged jobs to their shards.
    fn flush(&mut self) -> Result<(), NatsError> {
        submit_staged(&self.ledger, &mut self.staged).map_err(|e| NatsError::Ledger(e.to_string()))
    }

    /// Acknowledges each message whose outcome is durable now.
    async fn on_done(&mut self, dones: Vec<Done>) -> Result<(), NatsError> {
        for d in dones {
            let Some(acker) = self.in_flight.remove(&d.seq) else {
                continue;
            };
            // G7: on a failure nothing more is acknowledged; the server redelivers after a
            // restart.
            let (name, settle) = self
                .stats
                .outcomes
                .count(&d.outcome)
                .map_err(|e| NatsError::Ledger(e.to_string()))?;
            self.count_outcome(name, 1);
            match settle {
                Settle::Refuse => self.terminate(&acker).await,
                Settle::Ack => self.ack(&acker, AckKind::Ack).await,
            }
        }
        Ok(())
    }

    async fn terminate(&self, acker: &Acker) {
        self.ack(acker, AckKind::Term).await;
    }

    /// Sends one acknowledgement. A failed send (connection lost) leaves the message with
    /// the server: it is delivered again and answered `duplicate`.
    async fn ack(&self, acker: &Acker, kind: AckKind) {
        let (counter, meter, label) = match kind {
            AckKind::Ack => (&self.stats.acked, &self.meters.ack, "ack"),
            AckKind::Term => (&self.stats.terminated, &self.meters.term, "term"),
            _ => (&self.stats.naked, &self.meters.nak, "nak"),
        };
        match acker.ack_with(kind).await {
            Ok(()) => {
                counter.fetch_add(1, Ordering::Relaxed);
                meter
                    .get(|| {
                        metrics::counter!(metric::NATS_ACKED_TOTAL,
                            "subscriber" => self.sub.name.to_string(), "kind" => label)
                    })
                    .increment(1);
            }
            Err(e) => {
                tracing::warn!(subscriber = %self.sub.name, "nats {label} not sent (the message will be delivered again): {e}")
            }
        }
    }

    /// A pull that failed: heartbeats missed or the connection lost are passing (the
    /// stream pulls again once reconnected); a deleted consumer stops the binding.
    fn pull_error(
        &self,
        e: &async_nats::jetstream::consumer::pull::MessagesError,
    ) -> Result<(), NatsError> {
        use async_nats::jetstream::consumer::pull::MessagesErrorKind;
        match e.kind() {
            MessagesErrorKind::ConsumerDeleted => Err(NatsError::Client(format!(
                "durable consumer {:?} was deleted",
                self.config.durable
            ))),
            _ => {
                tracing::warn!(subscriber = %self.sub.name, durable = %self.config.durable, "nats pull: {e}");
                Ok(())
            }
        }
    }

    /// The consumer's pending counts as gauges (the lag the server reports).
    async fn report_pending(&self, consumer: &mut PullConsumer) {
        match tokio::time::timeout(SERVER_REPLY, consumer.info()).await {
            Ok(Ok(info)) => {
                metrics::gauge!(metric::NATS_CONSUMER_PENDING,
                    "subscriber" => self.sub.name.to_string())
                .set(info.num_pending as f64);
                metrics::gauge!(metric::NATS_CONSUMER_ACK_PENDING,
                    "subscriber" => self.sub.name.to_string())
                .set(info.num_ack_pending as f64);
            }
            Ok(Err(e)) => tracing::debug!(subscriber = %self.sub.name, "nats consumer info: {e}"),
            Err(_) => {
                tracing::debug!(subscriber = %self.sub.name, "nats consumer info: no answer within {SERVER_REPLY:?}")
            }
        }
    }

    /// Stop: acknowledges what becomes durable within `timeout`; `Nak`s the rest.
    async fn drain(
        &mut self,
        done_rx: &mut mpsc::UnboundedReceiver<Vec<Done>>,
        timeout: Duration,
    ) -> Result<(), NatsError> {
        self.flush()?;
        let deadline = tokio::time::Instant::now() + timeout;
        let finishing = async {
            while !self.in_flight.is_empty() {
                match tokio::time::timeout_at(deadline, done_rx.recv()).await {
                    Ok(Some(dones)) => self.on_done(dones).await?,
                    Ok(None) | Err(_) => break,
                }
            }
            Ok::<(), NatsError>(())
        };
        match tokio::time::timeout_at(deadline + SERVER_REPLY, finishing).await {
            Ok(finished) => finished?,
            Err(_) => {
                tracing::warn!(subscriber = %self.sub.name, "the nats client took no acks within {SERVER_REPLY:?} past nats.drain_timeout (not connected); what was not sent is delivered again, answered duplicate")
            }
        }
        if !self.in_flight.is_empty() {
            tracing::error!(subscriber = %self.sub.name, left = self.in_flight.len(), "in-flight nats messages did not finish within nats.drain_timeout; given back (Nak) to be delivered again");
            let delay = Some(self.config.nak_delay);
            let left = std::mem::take(&mut self.in_flight);
            let giving_back = async {
                for acker in left.values() {
                    self.ack(acker, AckKind::Nak(delay)).await;
                }
            };
            if tokio::time::timeout(SERVER_REPLY, giving_back)
                .await
                .is_err()
            {
                tracing::warn!(subscriber = %self.sub.name, "the nats client took no Nak within {SERVER_REPLY:?} (not connected); the rest return after ack_wait");
            }
        }
        Ok(())
    }

    fn log_progress(&self, what: &str) {
        let s = &self.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        tracing::info!(
            subscriber = %self.sub.name,
            received = get(&s.received),
            acked = get(&s.acked),
            terminated = get(&s.terminated),
            redelivered = get(&s.redelivered),
            processed = get(&s.outcomes.processed),
            duplicate = get(&s.outcomes.duplicate),
            in_flight = self.in_flight.len(),
            "{what}"
        );
    }
}

/// Headers as (name, value) pairs, every value of a name in the order sent. Names are
/// sorted: the client keeps them in a hash map, and a handler should see the same order
/// on every delivery.
fn headers_of(headers: Option<&async_nats::HeaderMap>) -> Vec<(String, String)> {
    let Some(h) = headers else {
        return Vec::new();
    };
    let mut names: Vec<_> = h.iter().collect();
    // By the name's text, borrowed (a key made with `to_string` allocated per comparison).
    names.sort_unstable_by(|a, b| AsRef::<str>::as_ref(a.0).cmp(b.0.as_ref()));
    names
        .into_iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |v| (name.to_string(), v.as_str().to_string()))
        })
        .collect()
}
