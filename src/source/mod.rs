//! Sources of messages, and the step they share.
//!
//! Every source turns what it received into a [`delivery::Delivery`] and hands it to
//! [`delivery::envelope`], which keys, fingerprints and routes it the same way for all of
//! them (and for the replay of stored records):
//!
//! - pipe mode (stdin JSON lines): [`stdin`];
//! - HTTP ingest (`POST /v1/subscribers/{s}/messages`): [`http`] reads a request as a
//!   delivery; the route itself is in `crate::admin` (the only user of axum);
//! - Kafka: [`kafka`] (the only importer of rdkafka);
//! - NATS JetStream: [`nats`] (the only importer of async-nats);
//! - MQTT 3.1.1 and 5: [`mqtt`] (the only importer of rumqttc);
//! - RabbitMQ (AMQP 0-9-1): [`rabbitmq`] (the only importer of lapin);
//! - the deterministic traffic generator used by `bench` and `demo`: [`generator`].
//!
//! [`readiness`] holds what `/readyz` asks of the running broker sources (a connection);
//! [`settle`] what the NATS, MQTT and RabbitMQ sources share between a shard's outcome and
//! the broker's acknowledgement; `time_until_acked` how the broker benches time a source.

pub mod delivery;
pub mod generator;
pub mod http;
pub mod kafka;
pub mod mqtt;
pub mod nats;
pub mod rabbitmq;
pub mod readiness;
pub mod settle;
pub mod stdin;

/// For the broker benches (`mqtt-bench`, `rabbitmq-bench`): waits until `acked` reaches
/// `count` or `shutdown` triggers, looking every 200 µs and telling `progress` the acks
/// every 200 ms; returns the time from the first message `received` to then (zero when
/// none arrived).
pub(crate) fn time_until_acked(
    received: &std::sync::atomic::AtomicU64,
    acked: &std::sync::atomic::AtomicU64,
    count: u64,
    shutdown: &crate::pipeline::Shutdown,
    mut progress: impl FnMut(u64),
) -> std::time::Duration {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};
    let mut start = None;
    let mut last_progress = Instant::now();
    while acked.load(Ordering::Relaxed) < count && !shutdown.is_triggered() {
        if start.is_none() && received.load(Ordering::Relaxed) > 0 {
            start = Some(Instant::now());
        }
        if last_progress.elapsed() > Duration::from_millis(200) {
            last_progress = Instant::now();
            progress(acked.load(Ordering::Relaxed));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    start.map_or(Duration::ZERO, |t| t.elapsed())
}
