//! The connection: one task polls the session (rumqttc's event loop must be polled
//! continuously and never cancelled midway), reconnects with backoff, and forwards what
//! the consumer needs over a bounded channel.
//!
//! Generations: every lost connection starts a new generation. A message carries the
//! generation it arrived on, and [`Link::ack`] queues its PUBACK only while that
//! generation is current: packet ids belong to one connection, and an id acknowledged on
//! the next one may by then name another message, whose outcome is not durable yet (G1).
//! The check and the queueing happen under the lock the failure path holds while it
//! drops the acks queued for the old connection, so none slips through.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::mpsc;

use super::session::{AckHandle, Client, Event, Events, Message, PollError};
use super::MqttError;

/// What the connection task tells the consumer, in the order it happened.
pub(crate) enum LinkEvent {
    /// CONNACK: connected (a new generation began at the loss before it).
    Connected { session_present: bool },
    /// SUBACK: every filter granted.
    Subscribed,
    /// A message that arrived on generation `gen`.
    Message { gen: u64, msg: Message },
    /// The connection was lost; a new generation starts (reconnecting after a pause).
    Lost { reason: String },
    /// The DISCONNECT of a stop was written, after every ack queued before it.
    Disconnected,
    /// The broker refused what no retry fixes; the task ended.
    Fatal(MqttError),
}

/// What became of an ack.
pub(crate) enum Acked {
    Queued,
    /// The message's connection is gone; the broker delivers it again.
    Stale,
    /// The client's request channel did not take it: full (offer it again later), or
    /// closed once the connection task has ended, which the consumer hears from the link.
    Refused,
}

struct State {
    gen: u64,
    up: bool,
    reason: String,
    connections: u64,
}

/// The connection's state, shared by the task, the consumer and `/readyz`.
pub(crate) struct Link {
    state: Mutex<State>,
}

impl Link {
    pub(crate) fn new() -> Link {
        Link {
            state: Mutex::new(State {
                gen: 0,
                up: false,
                reason: "connecting to the MQTT broker".into(),
                connections: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What `/readyz` says (`None`: connected).
    pub(crate) fn unready(&self) -> Option<String> {
        let s = self.lock();
        (!s.up).then(|| s.reason.clone())
    }

    /// Connections made so far.
    pub(crate) fn connections(&self) -> u64 {
        self.lock().connections
    }

    /// Queues the PUBACK of a message that arrived on generation `gen`, if that connection
    /// is still the current one. Call only once the message's outcome is durable.
    pub(crate) fn ack(&self, client: &Client, gen: u64, handle: &AckHandle) -> Acked {
        let s = self.lock();
        if s.gen != gen {
            return Acked::Stale;
        }
        match client.ack(handle) {
            Ok(()) => Acked::Queued,
            Err(_) => Acked::Refused,
        }
    }
}

/// Starts the task that polls `events` until the consumer goes away or the broker
/// refuses the session.
pub(crate) fn spawn(
    events: Events,
    link: Arc<Link>,
    tx: mpsc::Sender<LinkEvent>,
    backoff_max: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(drive(events, link, tx, backoff_max))
}

const FIRST_PAUSE: Duration = Duration::from_millis(100);

async fn drive(
    mut events: Events,
    link: Arc<Link>,
    tx: mpsc::Sender<LinkEvent>,
    backoff_max: Duration,
) {
    let mut pause = FIRST_PAUSE;
    loop {
        let event = match events.poll().await {
            Ok(Event::Connected { session_present }) => {
                pause = FIRST_PAUSE;
                let mut s = link.lock();
                s.up = true;
                s.connections += 1;
                LinkEvent::Connected { session_present }
            }
            Ok(Event::Message(msg)) => LinkEvent::Message {
                gen: link.lock().gen,
                msg,
            },
            Ok(Event::Subscribed) => LinkEvent::Subscribed,
            Ok(Event::Disconnected) => LinkEvent::Disconnected,
            Ok(Event::Other) => continue,
            Err(PollError::Lost(reason)) => {
                {
                    let mut s = link.lock();
                    s.gen += 1;
                    s.up = false;
                    s.reason = format!(
                        "not connected to the MQTT broker ({reason}); messages wait in the session until it reconnects"
                    );
                    // Acks queued between the failure and this lock were for the old
                    // connection's packet ids.
                    events.drop_queued_acks();
                }
                if tx.send(LinkEvent::Lost { reason }).await.is_err() {
                    return;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(backoff_max);
                continue;
            }
            Err(PollError::Fatal(e)) => {
                {
                    let mut s = link.lock();
                    s.up = false;
                    s.reason = e.to_string();
                }
                let _ = tx.send(LinkEvent::Fatal(e)).await;
                return;
            }
        };
        let last = matches!(event, LinkEvent::Disconnected);
        if tx.send(event).await.is_err() || last {
            return;
        }
    }
}
