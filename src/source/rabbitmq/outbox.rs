//! The outbox relay to RabbitMQ (`[rabbitmq.outbox]`): rows that handlers emitted are
//! published after the transaction that wrote them committed, on a channel in confirm
//! mode (publisher confirms), to `rabbitmq.outbox.exchange` with the emitted topic as the
//! routing key. Each message is persistent and `mandatory`, carries the row's
//! deterministic id as its `message_id` property (what a dedupd downstream keys on by
//! default) and as header `dedupd-message-id`, the emitted key, if any, as header
//! `dedupd-key`, and the emitted headers. A row is deleted only after the server
//! confirmed it (`basic.ack` of the confirm); a `basic.nack`, a message no queue took
//! (returned, since it is mandatory), a lost channel or a crash leaves the row, which is
//! published again later with the same id (at least once; consumers deduplicate by it).
//!
//! The relay runs beside the bindings of each session, on a channel of its own. At a stop
//! it runs after the bindings drained (their last commits may have emitted), until the
//! outbox is empty or `rabbitmq.drain_timeout` passed; what is left is relayed by the next
//! run.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{RabbitMqError, RabbitOutboxConfig};
use crate::ledger::{Ledger, OutboxRow};
use crate::source::relay::{report_lag, RelayStats};

/// The longest pause after a round the server did not take whole.
const REFUSED_MAX: Duration = Duration::from_secs(5);

/// How one row's publication ended.
#[derive(Debug, PartialEq, Eq)]
enum Published {
    /// Confirmed by the server: the row can go.
    Confirmed,
    /// Not taken (nacked, returned as unroutable, or not expressible in AMQP): the row
    /// stays and is tried again after `poll_interval`.
    Refused(String),
}

/// Relays until `finish` holds a deadline and the outbox is empty or the deadline passed.
/// Fails only when the ledger does; a lost channel is opened again.
pub(crate) async fn relay(
    conn: &Connection,
    ledger: &Arc<Ledger>,
    cfg: &RabbitOutboxConfig,
    stats: &RelayStats,
    mut finish: watch::Receiver<Option<Instant>>,
) -> Result<(), RabbitMqError> {
    let mut channel: Option<Channel> = None;
    // The pause after a round the server did not take whole: doubles up to REFUSED_MAX.
    let mut backoff = cfg.poll_interval;
    loop {
        let deadline = *finish.borrow_and_update();
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let left = pending(ledger, 1).await?.len();
            if left > 0 {
                tracing::warn!("rabbitmq outbox relay: stopping with rows not yet published (relayed by the next run)");
            }
            return Ok(());
        }
        let ch = match &channel {
            Some(ch) if ch.status().connected() => ch,
            _ => match open(conn).await {
                Ok(ch) => channel.insert(ch),
                Err(e) => {
                    tracing::warn!(
                        "rabbitmq outbox relay: cannot open its channel ({e}); trying again"
                    );
                    if deadline.is_some() {
                        return Ok(());
                    }
                    wait(ledger, Duration::from_secs(1), &mut finish).await;
                    continue;
                }
            },
        };
        let rows = pending(ledger, cfg.batch.get()).await?;
        report_lag(&rows);
        if rows.is_empty() {
            if deadline.is_some() {
                return Ok(());
            }
            wait(ledger, cfg.poll_interval, &mut finish).await;
            continue;
        }
        let outcomes = match publish(ch, &cfg.exchange, &rows).await {
            Ok(outcomes) => outcomes,
            Err(e) => {
                tracing::warn!("rabbitmq outbox relay: channel lost ({e}); the rows stay and are published again");
                channel = None;
                continue;
            }
        };
        let mut confirmed = Vec::with_capacity(rows.len());
        let mut refused = None;
        for (row, outcome) in rows.iter().zip(outcomes) {
            match outcome {
                Published::Confirmed => confirmed.push(row.id.clone()),
                Published::Refused(why) => {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    refused.get_or_insert((row, why));
                }
            }
        }
        let all = confirmed.len() == rows.len();
        if let Some((row, why)) = refused {
            tracing::warn!(
                exchange = %cfg.exchange,
                "rabbitmq outbox relay: {} of {} rows not taken, first topic {:?} (message id {}): {why}; they stay and are published again in {backoff:?}",
                rows.len() - confirmed.len(),
                rows.len(),
                row.topic,
                row.message_id,
            );
        }
        if !confirmed.is_empty() {
            let n = confirmed.len() as u64;
            let ledger = ledger.clone();
            tokio::task::spawn_blocking(move || ledger.outbox_ack(&confirmed))
                .await
                .map_err(|e| RabbitMqError::Ledger(format!("outbox ack: {e}")))?
                .map_err(|e| RabbitMqError::Ledger(e.to_string()))?;
            stats.relayed.fetch_add(n, Ordering::Relaxed);
        }
        if all {
            backoff = cfg.poll_interval;
        } else {
            // Something was refused (a missing binding stays missing for a while): do not
            // spin on it, nor fill the log.
            wait_out(backoff, deadline, &mut finish).await;
            backoff = (backoff * 2).min(REFUSED_MAX).max(cfg.poll_interval);
        }
    }
}

/// A channel in confirm mode.
async fn open(conn: &Connection) -> Result<Channel, lapin::Error> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(ch)
}

/// Up to `limit` pending rows (the read waits on the shards, so off the runtime's threads).
async fn pending(ledger: &Arc<Ledger>, limit: usize) -> Result<Vec<OutboxRow>, RabbitMqError> {
    let ledger = ledger.clone();
    tokio::task::spawn_blocking(move || ledger.outbox_pending(limit))
        .await
        .map_err(|e| RabbitMqError::Ledger(format!("outbox read: {e}")))?
        .map_err(|e| RabbitMqError::Ledger(e.to_string()))
}

/// Sleeps up to `d`, less when a handler emitted (the ledger wakes the relay) or a stop
/// sets the deadline.
async fn wait(ledger: &Ledger, d: Duration, finish: &mut watch::Receiver<Option<Instant>>) {
    let until = Instant::now() + d;
    let wakes = ledger.outbox_wakes();
    while Instant::now() < until && ledger.outbox_wakes() == wakes {
        tokio::select! {
            _ = finish.changed() => return,
            () = tokio::time::sleep(Duration::from_millis(10).min(d)) => {}
        }
    }
}

/// Sleeps `d`, not past `deadline`, and less when a stop sets one.
async fn wait_out(
    d: Duration,
    deadline: Option<Instant>,
    finish: &mut watch::Receiver<Option<Instant>>,
) {
    let until = deadline.map_or(Instant::now() + d, |end| end.min(Instant::now() + d));
    tokio::select! {
        _ = finish.changed() => {}
        () = tokio::time::sleep_until(until) => {}
    }
}

/// Publishes `rows` and waits for the server's confirms: one outcome per row, in order.
/// Fails when the channel is lost (no row is confirmed then).
async fn publish(
    ch: &Channel,
    exchange: &str,
    rows: &[OutboxRow],
) -> Result<Vec<Published>, lapin::Error> {
    let mut confirms = Vec::with_capacity(rows.len());
    for row in rows {
        let props = match properties(row) {
            Ok(props) => props,
            Err(why) => {
                confirms.push(Err(why.to_string()));
                continue;
            }
        };
        let confirm = ch
            .basic_publish(
                exchange.into(),
                row.topic.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &row.payload,
                props,
            )
            .await?;
        confirms.push(Ok(confirm));
    }
    let mut out = Vec::with_capacity(rows.len());
    for c in confirms {
        out.push(match c {
            Err(why) => Published::Refused(why),
            Ok(confirm) => match confirm.await? {
                Confirmation::Ack(None) => Published::Confirmed,
                Confirmation::Ack(Some(returned)) => Published::Refused(format!(
                    "no queue took it from exchange {exchange:?} (returned: {:?} {})",
                    returned.reply_code,
                    returned.reply_text.as_str()
                )),
                Confirmation::Nack(_) => Published::Refused("the server refused it (nack)".into()),
                Confirmation::NotRequested => {
                    Published::Refused("the channel is not in confirm mode".into())
                }
            },
        });
    }
    Ok(out)
}

/// Why a row cannot be published as a message.
#[derive(Debug, thiserror::Error)]
enum Unpublishable {
    #[error("header name of {0} bytes: AMQP allows at most 255")]
    HeaderName(usize),
}

/// The row's message properties: persistent, its id, its key and headers.
fn properties(row: &OutboxRow) -> Result<BasicProperties, Unpublishable> {
    let mut headers = FieldTable::default();
    let text = |v: &str| AMQPValue::LongString(v.as_bytes().to_vec().into());
    for (name, value) in &row.headers {
        if name.len() > 255 {
            return Err(Unpublishable::HeaderName(name.len()));
        }
        headers.insert(ShortString::from(name.as_str()), text(value));
    }
    headers.insert("dedupd-message-id".into(), text(&row.message_id));
    if let Some(key) = &row.key {
        headers.insert("dedupd-key".into(), text(key));
    }
    Ok(BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(row.message_id.as_str().into())
        .with_timestamp(row.written_at_ms / 1000)
        .with_headers(headers))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(headers: Vec<(String, String)>, key: Option<&str>) -> OutboxRow {
        OutboxRow {
            id: "0-1".into(),
            subscriber: "orders".into(),
            message_id: "5f2a".into(),
            topic: "counted".into(),
            key: key.map(str::to_string),
            headers,
            payload: b"1".to_vec(),
            written_at_ms: 1_700_000_000_123,
            changelog_partition: None,
        }
    }

    #[test]
    fn a_relayed_message_carries_its_id_key_and_headers() {
        let p = properties(&row(vec![("trace".into(), "t-1".into())], Some("o-7"))).unwrap();
        assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some("5f2a"));
        assert_eq!(*p.delivery_mode(), Some(2), "persistent");
        assert_eq!(*p.timestamp(), Some(1_700_000_000));
        let h = p.headers().as_ref().unwrap().inner();
        let get = |k: &str| match h.get(k) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(get("dedupd-message-id"), "5f2a");
        assert_eq!(get("dedupd-key"), "o-7");
        assert_eq!(get("trace"), "t-1");
        let p = properties(&row(vec![], None)).unwrap();
        assert!(!p
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .contains_key("dedupd-key"));
    }

    #[test]
    fn a_header_name_amqp_cannot_carry_keeps_the_row() {
        let e = properties(&row(vec![("h".repeat(256), "v".into())], None)).unwrap_err();
        assert!(matches!(e, Unpublishable::HeaderName(256)), "{e}");
        assert!(e.to_string().contains("at most 255"), "{e}");
    }
}
