//! What the outbox relays (Kafka's `kafka/outbox.rs`, RabbitMQ's `rabbitmq/outbox.rs`)
//! share: their counters and the backlog gauges.

use std::sync::atomic::AtomicU64;

use crate::ledger::OutboxRow;
use crate::telemetry::metric;

/// Live counters of a relay.
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Rows the broker acknowledged (then deleted from the outbox).
    pub(crate) relayed: AtomicU64,
    /// Publications that failed or the broker refused (the row stays and is tried again).
    pub(crate) failed: AtomicU64,
}

/// Sets `dedupd_outbox_relay_lag_rows` and `_seconds` from a round's pending `rows`.
pub(crate) fn report_lag(rows: &[OutboxRow]) {
    let oldest = rows.iter().map(|r| r.written_at_ms).min();
    let now = crate::source::settle::now_ms();
    metrics::gauge!(metric::OUTBOX_RELAY_LAG_ROWS).set(rows.len() as f64);
    metrics::gauge!(metric::OUTBOX_RELAY_LAG_SECONDS)
        .set(oldest.map_or(0.0, |t| now.saturating_sub(t) as f64 / 1000.0));
}
