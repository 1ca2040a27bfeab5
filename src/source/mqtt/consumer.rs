//! The session's messages, keyed, decided and acknowledged.
//!
//! Acknowledgement (G1): a message's PUBACK is queued only after the shard's `Done` for
//! it says its outcome is durable, and in the order the messages arrived (MQTT 3.1.1
//! §4.6 and MQTT 5 §4.6 ask for PUBACKs in PUBLISH order): one slow message holds back the
//! acks behind it, never the work. `processed`, `duplicate`, `quarantined`,
//! `dead_lettered` and `rejected` are all acknowledged — MQTT has no reject, so input
//! that cannot be keyed is kept as a dead-letter record first, then acknowledged. A crash
//! before an ack leaves the message in the broker's session: it is delivered again (DUP)
//! when dedupd reconnects, and the ledger answers `duplicate`.
//!
//! A lost connection voids the packet ids of its messages ([`super::link`]): their
//! outcomes still become durable, but they are not acknowledged; the broker delivers them
//! again on the new connection, and that delivery is acknowledged.
//!
//! A PUBACK the client cannot take (its request channel full: mosquitto 2.0.11 sends a
//! session's queued backlog faster than the connection task writes the acks, past the
//! window) waits in `unsent`, in order, and is offered again at the next outcome, event
//! batch or tick; the acks behind it queue after it. It used to be dropped (the message
//! stayed unacknowledged until the next connection, and with the broker waiting for the
//! acks the source stalled until a restart).
//!
//! Backpressure: at most `receive_maximum` messages are held (the broker honours it with
//! MQTT 5; with 3.1.1 its `max_inflight_messages` should be no larger); while the window is
//! full the consumer stops taking events, the connection task's channel fills and it stops
//! reading the socket.
//!
//! Stop: no new messages are taken (those still arriving stay unacknowledged in the
//! session); in-flight ones are acknowledged as their outcomes become durable, up to
//! `mqtt.drain_timeout`; then a DISCONNECT after the queued acks, which keeps the session
//! (none when the connection is gone: the stop then ends without waiting for one).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::config::match_filter;
use super::link::{self, Acked, Link, LinkEvent};
use super::session::{self, AckHandle, Client, Message};
use super::{MqttConfig, MqttError, MqttStats};
use crate::ledger::{Done, Job, Ledger, Origin, Subscriber};
use crate::pipeline::Shutdown;
use crate::source::delivery::{
    route_or_return, Delivery, Keying, Payload, Routed, Target, Unrouted,
};
use crate::source::settle::{
    bridge_dones, keep_dead_letter, now_ms, submit_staged, Meter, OutcomeMeters,
};
use crate::telemetry::metric;

/// Events buffered between the connection task and the consumer.
const LINK_BUFFER: usize = 64;
/// How often a stop offers refused PUBACKs again.
const UNSENT_RETRY: Duration = Duration::from_millis(20);
/// How long a stop waits at least for the DISCONNECT (after the queued acks) to be
/// written.
const DISCONNECT_WAIT: Duration = Duration::from_secs(5);

/// One `[[mqtt.subscription]]` at run time.
struct Route {
    sub: Arc<Subscriber>,
    filters: Vec<String>,
    id_level: Option<usize>,
    stats: Arc<MqttStats>,
    meters: Meters,
}

/// A subscription's metric counters, each looked up once (see [`Meter`]).
#[derive(Default)]
struct Meters {
    received: Meter,
    redelivered: Meter,
    acked: Meter,
    unacked_lost: Meter,
    outcomes: OutcomeMeters,
}

/// A message of the current connection, waiting for its outcome or for the acks before
/// it.
struct Held {
    seq: u64,
    route: usize,
    gen: u64,
    ack: AckHandle,
    done: bool,
}

struct Consumer {
    ledger: Arc<Ledger>,
    client: Client,
    link: Arc<Link>,
    routes: Vec<Route>,
    ack_tx: crossbeam_channel::Sender<Vec<Done>>,
    /// The current connection's messages in arrival order (seqs ascending).
    queue: VecDeque<Held>,
    /// Messages of lost connections whose outcomes are not durable yet: seq -> route.
    stale: HashMap<u64, usize>,
    /// Durable messages whose PUBACK the client refused (its request channel full), in
    /// arrival order: offered again before any later ack. Not counted in `held`: the
    /// consumer must keep taking events, or the connection task that drains the channel
    /// would stop too.
    unsent: VecDeque<Held>,
    /// Whether the wait in `unsent` has been reported since it last emptied.
    unsent_warned: bool,
    next_seq: u64,
    staged: Vec<Vec<Job>>,
    window: usize,
    /// Messages that arrived during the stop and were left to the session.
    left_at_stop: u64,
}

/// Runs the session until `shutdown` triggers, then drains; returns the connections
/// made. An error leaves every message it did not acknowledge in the session.
pub(super) async fn run(
    ledger: Arc<Ledger>,
    mqtt: &MqttConfig,
    shutdown: &Shutdown,
    stats: &[Arc<MqttStats>],
) -> Result<u64, MqttError> {
    let mut routes = Vec::new();
    for (s, st) in mqtt.subscriptions.iter().zip(stats) {
        let sub = ledger
            .subscriber(&s.subscriber)
            .map_err(|e| MqttError::Ledger(e.to_string()))?;
        routes.push(Route {
            sub,
            filters: s.topics.clone(),
            id_level: s.id_topic_level,
            stats: st.clone(),
            meters: Meters::default(),
        });
    }
    let (client, events) = session::open(mqtt)?;
    let link = Arc::new(Link::new());
    let probe = link.clone();
    let _ready = crate::source::readiness::register("mqtt", Arc::new(move || probe.unready()));
    let (tx, mut rx) = mpsc::channel(LINK_BUFFER);
    let task = link::spawn(events, link.clone(), tx, mqtt.reconnect_backoff_max);
    let (ack_tx, mut done_rx) = bridge_dones("dedupd-mqtt-acks".into());
    tracing::info!(broker = %mqtt.broker, client_id = %mqtt.client_id, protocol = ?mqtt.protocol,
        window = mqtt.receive_maximum.get(), "mqtt consumer started");
    let mut c = Consumer {
        staged: (0..ledger.shard_count()).map(|_| Vec::new()).collect(),
        ledger,
        client,
        link: link.clone(),
        routes,
        ack_tx,
        queue: VecDeque::new(),
        stale: HashMap::new(),
        unsent: VecDeque::new(),
        unsent_warned: false,
        next_seq: 0,
        window: usize::from(mqtt.receive_maximum.get()),
        left_at_stop: 0,
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut logged = 0;
    let result = async {
        loop {
            tokio::select! {
                biased;
                () = shutdown.triggered() => break,
                dones = done_rx.recv() => match dones {
                    Some(dones) => c.on_done(dones)?,
                    None => return Err(MqttError::Ledger("the ledger stopped answering".into())),
                },
                ev = rx.recv(), if c.held() < c.window => {
                    c.on_event(ev).await?;
                    // Whatever else arrived already joins the same submission.
                    while c.held() < c.window {
                        match rx.try_recv() {
                            Ok(ev) => c.on_event(Some(ev)).await?,
                            Err(_) => break,
                        }
                    }
                    c.flush()?;
                    c.retry_unsent();
                },
                _ = tick.tick() => {
                    c.retry_unsent();
                    let now = c.total(|s| &s.received) + c.total(|s| &s.acked);
                    if now != logged {
                        logged = now;
                        c.log_progress("mqtt progress");
                    }
                }
            }
        }
        c.drain(&mut rx, &mut done_rx, mqtt.drain_timeout).await
    }
    .await;
    task.abort();
    c.log_progress("mqtt consumer stopped");
    result.map(|()| link.connections())
}

impl Consumer {
    fn held(&self) -> usize {
        self.queue.len() + self.stale.len()
    }

    fn total(&self, f: impl Fn(&MqttStats) -> &AtomicU64) -> u64 {
        self.routes
            .iter()
            .map(|r| f(&r.stats).load(Ordering::Relaxed))
            .sum()
    }

    /// Adds one to the route's counter `name`, kept in `meter` (looked up the first time).
    fn count(&self, route: usize, meter: impl Fn(&Meters) -> &Meter, name: &'static str) {
        let r = &self.routes[route];
        meter(&r.meters)
            .get(|| metrics::counter!(name, "subscriber" => r.sub.name.to_string()))
            .increment(1);
    }

    async fn on_event(&mut self, ev: Option<LinkEvent>) -> Result<(), MqttError> {
        match ev {
            None => Err(MqttError::Client("the connection task ended".into())),
            Some(LinkEvent::Message { gen, msg }) => self.accept(gen, msg).await,
            Some(LinkEvent::Connected { session_present }) => {
                let first = self.link.connections() == 1;
                if session_present || first {
                    tracing::info!(session_present, "mqtt connected");
                } else {
                    tracing::warn!("mqtt connected, but the broker had no session for this client id (expired, or the broker lost it): messages published while dedupd was away were not kept for it");
                }
                metrics::counter!(metric::MQTT_CONNECTIONS_TOTAL).increment(1);
                // Every connect: the config is the truth (a filter added since the session
                // began is subscribed too).
                let filters: Vec<String> =
                    self.routes.iter().flat_map(|r| r.filters.clone()).collect();
                self.client.subscribe(&filters)
            }
            Some(LinkEvent::Subscribed) => {
                tracing::info!("mqtt subscribed");
                Ok(())
            }
            Some(LinkEvent::Lost { reason }) => {
                self.lose();
                tracing::warn!(%reason, stale = self.stale.len(), "mqtt connection lost; reconnecting (unacknowledged messages come again, answered duplicate once durable)");
                Ok(())
            }
            Some(LinkEvent::Disconnected) => Ok(()),
            Some(LinkEvent::Fatal(e)) => Err(e),
        }
    }

    /// The connection is gone: its messages are no longer acknowledged (their packet ids
    /// are void); the broker delivers them again on the next one.
    fn lose(&mut self) {
        let mut unacked: Vec<usize> = std::mem::take(&mut self.unsent)
            .into_iter()
            .map(|h| h.route)
            .collect();
        for h in std::mem::take(&mut self.queue) {
            if h.done {
                unacked.push(h.route);
            } else {
                self.stale.insert(h.seq, h.route);
            }
        }
        for route in unacked {
            self.count_unacked(route);
        }
    }

    fn count_unacked(&self, route: usize) {
        self.routes[route]
            .stats
            .unacked_lost
            .fetch_add(1, Ordering::Relaxed);
        self.count(route, |k| &k.unacked_lost, metric::MQTT_UNACKED_LOST_TOTAL);
    }

    /// The subscription whose filter the topic matches (the first listed).
    fn route_of(&self, topic: &str) -> Option<usize> {
        self.routes.iter().position(|r| {
            r.filters
                .iter()
                .any(|f| rumqttc::matches(topic, match_filter(f)))
        })
    }

    /// Keys and routes one message; input that cannot be keyed (or a topic no
    /// subscription names, left in the session by an earlier config) is dead-lettered.
    async fn accept(&mut self, gen: u64, m: Message) -> Result<(), MqttError> {
        let routed = self.route_of(&m.topic);
        let route = routed.unwrap_or(0);
        let stats = &self.routes[route].stats;
        stats.received.fetch_add(1, Ordering::Relaxed);
        self.count(route, |k| &k.received, metric::MQTT_RECEIVED_TOTAL);
        if m.dup {
            stats.redelivered.fetch_add(1, Ordering::Relaxed);
            self.count(route, |k| &k.redelivered, metric::MQTT_REDELIVERED_TOTAL);
        }
        if routed.is_none() {
            let reason = format!(
                "the topic {:?} matches no [[mqtt.subscription]] filter (a subscription the session kept from an earlier config?)",
                m.topic
            );
            let back = Unrouted {
                id: None,
                origin: Some(Origin::from(format!("mqtt:{}", m.topic))),
                key: Some(m.topic),
                headers: m.properties,
                payload: m.payload.to_vec(),
            };
            return self.reject(back, reason, route, gen, m.ack).await;
        }
        let r = &self.routes[route];
        let id = r
            .id_level
            .and_then(|l| m.topic.split('/').nth(l))
            .map(str::to_string);
        let delivery = Delivery {
            id,
            origin: Some(Origin::from(format!("mqtt:{}", m.topic))),
            key: Some(m.topic),
            headers: m.properties,
            received_at_ms: now_ms(),
            ..Delivery::new(
                Target::Resolved(r.sub.clone()),
                Payload::Bytes(m.payload.to_vec()),
            )
        };
        // A refused message comes back whole for its dead-letter record: nothing is copied
        // beforehand for the rare one refused.
        match route_or_return(&self.ledger, delivery, Keying::Derive, self.ack_tx.clone()) {
            Ok(Routed { mut job, shard, .. }) => {
                let seq = self.next_seq;
                self.next_seq += 1;
                job.seq = seq;
                self.queue.push_back(Held {
                    seq,
                    route,
                    gen,
                    ack: m.ack,
                    done: false,
                });
                self.staged[shard].push(job);
                Ok(())
            }
            Err(refused) => {
                let (e, back) = *refused;
                self.reject(back, e.to_string(), route, gen, m.ack).await
            }
        }
    }

    /// Unusable input: a durable dead-letter record first, then the ack in its turn (G1:
    /// never an ack for a message whose record is not durable).
    async fn reject(
        &mut self,
        d: Unrouted,
        reason: String,
        route: usize,
        gen: u64,
        ack: AckHandle,
    ) -> Result<(), MqttError> {
        tracing::warn!(subscriber = %self.routes[route].sub.name, %reason, "mqtt message rejected: kept as a dead letter, then acknowledged");
        let about = serde_json::json!({
            "origin": d.origin.map(|o| o.to_string()),
            "key": d.key,
            "headers": d.headers,
        });
        let r = &self.routes[route];
        keep_dead_letter(
            &self.ledger,
            &r.sub.name,
            &r.stats.outcomes,
            reason,
            about,
            &d.payload,
        )
        .await
        .map_err(|e| MqttError::Ledger(e.to_string()))?;
        self.count_outcome(route, "rejected");
        let seq = self.next_seq;
        self.next_seq += 1;
        self.queue.push_back(Held {
            seq,
            route,
            gen,
            ack,
            done: true,
        });
        self.release();
        Ok(())
    }

    fn count_outcome(&self, route: usize, outcome: &'static str) {
        let r = &self.routes[route];
        r.meters.outcomes.increment(outcome, 1, |outcome| {
            metrics::counter!(metric::MQTT_MESSAGES_TOTAL,
                "subscriber" => r.sub.name.to_string(), "outcome" => outcome)
        });
    }

    /// Submits the staged jobs to their shards.
    fn flush(&mut self) -> Result<(), MqttError> {
        submit_staged(&self.ledger, &mut self.staged).map_err(|e| MqttError::Ledger(e.to_string()))
    }

    /// Records durable outcomes and acknowledges what they release.
    fn on_done(&mut self, dones: Vec<Done>) -> Result<(), MqttError> {
        for d in dones {
            let (route, stale) = match self.stale.remove(&d.seq) {
                Some(route) => (route, true),
                None => match self.queue.binary_search_by_key(&d.seq, |h| h.seq) {
                    Ok(i) => {
                        self.queue[i].done = true;
                        (self.queue[i].route, false)
                    }
                    Err(_) => continue,
                },
            };
            let st = &self.routes[route].stats;
            // G7: on a failure nothing more is acknowledged; the session keeps the rest.
            // MQTT has no reject: every durable outcome is acknowledged.
            let (name, _) = st
                .outcomes
                .count(&d.outcome)
                .map_err(|e| MqttError::Ledger(e.to_string()))?;
            self.count_outcome(route, name);
            if stale {
                self.count_unacked(route);
            }
        }
        self.release();
        Ok(())
    }

    /// Acknowledges the durable messages at the front of the arrival order, behind any
    /// the client refused before.
    fn release(&mut self) {
        self.retry_unsent();
        while self.queue.front().is_some_and(|h| h.done) {
            let Some(h) = self.queue.pop_front() else {
                break;
            };
            if !self.unsent.is_empty() {
                self.unsent.push_back(h);
                continue;
            }
            if let Some(h) = self.send_ack(h) {
                self.unsent.push_back(h);
            }
        }
        if !self.unsent.is_empty() && !self.unsent_warned {
            self.unsent_warned = true;
            tracing::warn!(
                waiting = self.unsent.len(),
                "the mqtt client's request queue is full (the broker sends faster than the acks are written, past the window): PUBACKs wait and are sent in order as it drains"
            );
        }
    }

    /// Offers the refused PUBACKs again, oldest first, until the client refuses one.
    fn retry_unsent(&mut self) {
        while let Some(h) = self.unsent.pop_front() {
            if let Some(h) = self.send_ack(h) {
                self.unsent.push_front(h);
                return;
            }
        }
        self.unsent_warned = false;
    }

    /// Queues `h`'s PUBACK; gives `h` back when the client's request channel is full.
    fn send_ack(&self, h: Held) -> Option<Held> {
        match self.link.ack(&self.client, h.gen, &h.ack) {
            Acked::Queued => {
                self.routes[h.route]
                    .stats
                    .acked
                    .fetch_add(1, Ordering::Relaxed);
                self.count(h.route, |k| &k.acked, metric::MQTT_ACKED_TOTAL);
                None
            }
            Acked::Stale => {
                self.count_unacked(h.route);
                None
            }
            Acked::Refused => Some(h),
        }
    }

    /// Stop: acknowledges what becomes durable within `timeout`, then disconnects after
    /// the queued acks. Messages still arriving are left in the session.
    async fn drain(
        &mut self,
        rx: &mut mpsc::Receiver<LinkEvent>,
        done_rx: &mut mpsc::UnboundedReceiver<Vec<Done>>,
        timeout: Duration,
    ) -> Result<(), MqttError> {
        self.flush()?;
        let deadline = tokio::time::Instant::now() + timeout;
        while self.held() > 0 || !self.unsent.is_empty() {
            tokio::select! {
                dones = done_rx.recv() => match dones {
                    Some(dones) => self.on_done(dones)?,
                    None => break,
                },
                ev = rx.recv() => if !self.at_stop(ev) { break },
                () = tokio::time::sleep(UNSENT_RETRY), if !self.unsent.is_empty() => self.retry_unsent(),
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        if !self.unsent.is_empty() {
            tracing::error!(left = self.unsent.len(), "mqtt PUBACKs the client could not take within mqtt.drain_timeout; those messages stay in the session (delivered again at the next start, answered duplicate)");
            for h in std::mem::take(&mut self.unsent) {
                self.count_unacked(h.route);
            }
        }
        if self.held() > 0 {
            tracing::error!(left = self.held(), "in-flight mqtt messages did not finish within mqtt.drain_timeout; left unacknowledged in the session (delivered again at the next start)");
        }
        match self.link.unready() {
            // No connection to write a DISCONNECT (or queued PUBACKs) to: waiting for one
            // would only hold the stop for the whole drain.
            Some(reason) => {
                tracing::warn!(%reason, "mqtt not connected at the stop; no DISCONNECT sent (what was not acknowledged stays in the session, delivered again and answered duplicate)")
            }
            None => self.disconnect(rx, timeout).await,
        }
        if self.left_at_stop > 0 {
            tracing::info!(
                left = self.left_at_stop,
                "messages that arrived during the stop stay in the session"
            );
        }
        Ok(())
    }

    /// Sends the DISCONNECT after the queued acks and waits until it is written, the
    /// connection is lost, or `timeout` (at least [`DISCONNECT_WAIT`]) passes.
    async fn disconnect(&mut self, rx: &mut mpsc::Receiver<LinkEvent>, timeout: Duration) {
        self.client.disconnect();
        // The DISCONNECT goes out after every queued PUBACK: after a large backlog tens of
        // thousands may still be queued, so the wait is the drain's, at least 5 s.
        let deadline = tokio::time::Instant::now() + timeout.max(DISCONNECT_WAIT);
        loop {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(LinkEvent::Disconnected) => break,
                    Some(LinkEvent::Lost { reason }) => {
                        self.lose();
                        tracing::warn!(%reason, "the mqtt connection was lost during the stop; no DISCONNECT sent, and acks still queued are lost with it (those messages come again, answered duplicate)");
                        break;
                    }
                    ev => if !self.at_stop(ev) { break },
                },
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!("the mqtt DISCONNECT was not written in time; acks still queued are lost (those messages come again, answered duplicate)");
                    break;
                }
            }
        }
    }

    /// An event during the stop: messages are left to the session. False when the
    /// connection task is gone.
    fn at_stop(&mut self, ev: Option<LinkEvent>) -> bool {
        match ev {
            Some(LinkEvent::Message { .. }) => self.left_at_stop += 1,
            Some(LinkEvent::Lost { .. }) => self.lose(),
            Some(LinkEvent::Connected { .. } | LinkEvent::Subscribed | LinkEvent::Disconnected) => {
            }
            Some(LinkEvent::Fatal(_)) | None => return false,
        }
        true
    }

    fn log_progress(&self, what: &str) {
        tracing::info!(
            received = self.total(|s| &s.received),
            acked = self.total(|s| &s.acked),
            redelivered = self.total(|s| &s.redelivered),
            processed = self.total(|s| &s.outcomes.processed),
            duplicate = self.total(|s| &s.outcomes.duplicate),
            rejected = self.total(|s| &s.outcomes.rejected),
            unacked_lost = self.total(|s| &s.unacked_lost),
            in_flight = self.held(),
            "{what}"
        );
    }
}
