//! The outbox relay: rows that handlers emitted are produced to their topics after the
//! transaction that wrote them committed, each with its deterministic `dedupd-message-id`
//! header, by an idempotent producer (`enable.idempotence=true`, `acks=all`). A row is
//! deleted only after the broker acknowledged it, so a crash relays it again (at least
//! once; consumers deduplicate by the message id).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

use crate::ledger::{Ledger, OutboxRow};

use super::{KafkaConfig, KafkaError};
use crate::source::relay::{report_lag, RelayStats};

/// The delivery opaque of a changelog tombstone (a row's is its index in the round).
const TOMBSTONE: usize = usize::MAX;

struct RelayContext {
    tx: Sender<(usize, Result<(), rdkafka::error::KafkaError>)>,
}

impl ClientContext for RelayContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        crate::source::kafka::logging::log(level, fac, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        crate::source::kafka::logging::error(&error, reason);
    }
}

impl ProducerContext for RelayContext {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, index: usize) {
        let r = match result {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(e.clone()),
        };
        let _ = self.tx.send((index, r));
    }
}

/// Relays outbox rows until `stop` is set and a last round found nothing more.
pub(crate) fn run_relay(
    ledger: &Ledger,
    kafka: &KafkaConfig,
    stop: &AtomicBool,
    stats: &RelayStats,
) -> Result<(), KafkaError> {
    let (tx, reports) = unbounded();
    let producer: ThreadedProducer<RelayContext> = super::producer_config(kafka)
        .create_with_context(RelayContext { tx })
        .map_err(|source| KafkaError::Client {
            what: "outbox relay producer".into(),
            source,
        })?;
    let batch = kafka.outbox.batch.get();
    // The changelog of each subscriber that publishes one: its emitted records are
    // tombstoned once relayed, so the partition's next owner does not relay them again.
    let changelogs: HashMap<&str, String> = kafka
        .subscriptions
        .iter()
        .filter(|s| s.changelog)
        .map(|s| {
            (
                s.subscriber.as_str(),
                super::changelog::topic_name(&kafka.changelog.prefix, &s.subscriber),
            )
        })
        .collect();
    let _relaying = ledger.attach_outbox_relay();
    let mut stopping_since: Option<Instant> = None;
    loop {
        if stop.load(Ordering::Relaxed) {
            let since = *stopping_since.get_or_insert_with(Instant::now);
            if since.elapsed() > kafka.drain_timeout {
                // Rows stay in the outbox and are relayed after the next start.
                tracing::warn!(
                    "outbox relay: stopping with rows not yet relayed (broker unreachable?)"
                );
                return Ok(());
            }
        }
        let rows = ledger.outbox_pending(batch)?;
        report_lag(&rows);
        if rows.is_empty() {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            wait_for_rows(ledger, kafka.outbox.poll_interval, stop);
            continue;
        }
        let acked = produce(&producer, &reports, &rows, kafka.drain_timeout, stats);
        tombstone(&producer, &changelogs, &rows, &acked, kafka.drain_timeout);
        let acked: Vec<String> = acked.into_iter().map(|i| rows[i].id.clone()).collect();
        if !acked.is_empty() {
            ledger.outbox_ack(&acked)?;
            stats
                .relayed
                .fetch_add(acked.len() as u64, Ordering::Relaxed);
        }
        if acked.len() < rows.len() {
            // Something failed: do not spin on it.
            std::thread::sleep(kafka.outbox.poll_interval);
        }
    }
}

/// Sleeps up to `poll_interval`, less when a handler emitted (the ledger wakes the relay)
/// or `stop` is set.
fn wait_for_rows(ledger: &Ledger, poll_interval: Duration, stop: &AtomicBool) {
    let until = Instant::now() + poll_interval;
    let wakes = ledger.outbox_wakes();
    while Instant::now() < until && !stop.load(Ordering::Relaxed) && ledger.outbox_wakes() == wakes
    {
        std::thread::sleep(Duration::from_millis(10).min(poll_interval));
    }
}

/// Produces `rows` and waits for their delivery reports: the indexes of the rows the
/// broker acknowledged. A finished flush means every delivery report was served
/// (librdkafka counts unserved reports as outstanding); a report still missing leaves its
/// row pending.
fn produce(
    producer: &ThreadedProducer<RelayContext>,
    reports: &Receiver<(usize, Result<(), rdkafka::error::KafkaError>)>,
    rows: &[OutboxRow],
    drain_timeout: Duration,
    stats: &RelayStats,
) -> Vec<usize> {
    let mut sent = 0usize;
    for (i, row) in rows.iter().enumerate() {
        let mut headers = OwnedHeaders::new_with_capacity(row.headers.len() + 1).insert(Header {
            key: "dedupd-message-id",
            value: Some(row.message_id.as_bytes()),
        });
        for (k, v) in &row.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record: BaseRecord<'_, str, [u8], usize> =
            BaseRecord::with_opaque_to(&row.topic, i)
                .payload(row.payload.as_slice())
                .headers(headers);
        if let Some(k) = &row.key {
            record = record.key(k.as_str());
        }
        match producer.send(record) {
            Ok(()) => sent += 1,
            Err((e, _)) => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "outbox relay: producing to {} failed, retrying later: {e}",
                    row.topic
                );
            }
        }
    }
    if let Err(e) = producer.flush(drain_timeout) {
        tracing::warn!("outbox relay: flush did not finish: {e}");
    }
    let mut acked = Vec::with_capacity(sent);
    let deadline = Instant::now() + Duration::from_millis(100);
    while acked.len() < sent {
        let left = deadline.saturating_duration_since(Instant::now());
        match reports.recv_timeout(left) {
            Ok((TOMBSTONE, _)) => {} // a changelog tombstone of an earlier round
            Ok((i, Ok(()))) => {
                if i < rows.len() {
                    acked.push(i);
                }
            }
            Ok((i, Err(e))) => {
                sent -= 1;
                stats.failed.fetch_add(1, Ordering::Relaxed);
                if let Some(row) = rows.get(i) {
                    tracing::warn!(
                        "outbox relay: {} not delivered, retrying later: {e}",
                        row.topic
                    );
                }
            }
            Err(_) => break,
        }
    }
    acked
}

/// Tombstones the emitted records of the relayed rows `acked` in their changelogs, so the
/// partition's next owner does not relay them again.
fn tombstone(
    producer: &ThreadedProducer<RelayContext>,
    changelogs: &HashMap<&str, String>,
    rows: &[OutboxRow],
    acked: &[usize],
    drain_timeout: Duration,
) {
    let mut tombstones = 0;
    for &i in acked {
        let row = &rows[i];
        let (Some(topic), Some(partition)) = (
            changelogs.get(row.subscriber.as_str()),
            row.changelog_partition,
        ) else {
            continue;
        };
        let key = super::changelog::emitted_key(&row.message_id);
        let record = BaseRecord::<'_, [u8], [u8], usize>::with_opaque_to(topic, TOMBSTONE)
            .partition(partition)
            .key(&key[..]);
        match producer.send(record) {
            Ok(()) => tombstones += 1,
            Err((e, _)) => tracing::warn!(
                "outbox relay: tombstoning {:?} in {topic} failed (the partition's next owner relays it again, with the same id): {e}",
                row.message_id
            ),
        }
    }
    if tombstones > 0 {
        if let Err(e) = producer.flush(drain_timeout) {
            tracing::warn!("outbox relay: flush of changelog tombstones did not finish: {e}");
        }
    }
}
