//! The outbox's stored layout: one JSON row per message a handler emitted, written in the
//! transaction that commits the message's claim and read by the relay until the broker
//! acknowledged it (`source/kafka/outbox.rs`).
//!
//! Field names are those of the first layout, so existing data directories read
//! unchanged. The first layout kept the payload as text, replacing bytes that are not
//! UTF-8, which altered a handler's binary `emit`; such a payload is now kept as
//! `payload_base64`, like quarantine and dead-letter records do (`records/layout.rs`).

use redb::{ReadableTableMetadata, WriteTransaction};
use serde::{Deserialize, Serialize};

use crate::effects::OutboxMessage;
use crate::ledger::format::tables::OUTBOX;
use crate::ledger::records::{StoredPayload, StoredRecordError};

/// One emitted message as the outbox stores it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct OutboxRecord {
    pub(crate) v: u32,
    pub(crate) subscriber: String,
    /// Deterministic id derived from the incoming message id.
    pub(crate) id: String,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) written_at_ms: u64,
    /// The changelog partition holding the message's emitted record, if any: the relay
    /// tombstones it there once the message is relayed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) changelog_partition: Option<i32>,
    #[serde(flatten)]
    pub(crate) payload: StoredPayload,
}

impl OutboxRecord {
    pub(crate) fn of(subscriber: &str, m: &OutboxMessage, now_ms: u64) -> OutboxRecord {
        OutboxRecord {
            v: 1,
            subscriber: subscriber.to_string(),
            id: m.id.clone(),
            topic: m.topic.clone(),
            key: m.key.clone(),
            headers: m.headers.clone(),
            written_at_ms: now_ms,
            changelog_partition: m.changelog_partition,
            payload: StoredPayload::of(&m.payload),
        }
    }

    /// Reads a stored row; `Err` says what is wrong with it.
    pub(crate) fn decode(row: &[u8]) -> Result<OutboxRecord, StoredRecordError> {
        Ok(serde_json::from_slice(row)?)
    }
}

/// Pending outbox rows of a shard at which a warning says nothing consumes them; it is
/// repeated each time the count has doubled since the last one.
pub(crate) const WARN_ROWS: u64 = 100_000;

/// Whether `rows` pending (after a write) deserve a warning, the last one having been
/// given at `warned` rows (0: none).
pub(crate) fn warn_now(rows: u64, warned: u64) -> bool {
    rows >= WARN_ROWS && rows >= warned.saturating_mul(2)
}

/// Appends a subscriber's emitted messages to the outbox, numbered from
/// `next_outbox_seq`. Durable with the caller's transaction. Returns the rows pending in
/// the shard's outbox after the write (0 when there was nothing to write).
pub(crate) fn write(
    txn: &WriteTransaction,
    sub: &str,
    outbox: &[OutboxMessage],
    next_outbox_seq: &mut u64,
    now_ms: u64,
) -> Result<u64, redb::Error> {
    if outbox.is_empty() {
        return Ok(0);
    }
    let mut t = txn.open_table(OUTBOX)?;
    for m in outbox {
        let row = OutboxRecord::of(sub, m, now_ms);
        t.insert(
            *next_outbox_seq,
            serde_json::to_vec(&row).unwrap_or_default().as_slice(),
        )?;
        *next_outbox_seq += 1;
    }
    Ok(t.len()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &[u8]) -> OutboxMessage {
        OutboxMessage {
            id: "m#0".into(),
            topic: "labels".into(),
            key: Some("k".into()),
            headers: vec![("h".into(), "v".into())],
            payload: payload.to_vec(),
            changelog_partition: None,
        }
    }

    #[test]
    fn a_growing_outbox_is_warned_about_at_each_doubling() {
        assert!(!warn_now(WARN_ROWS - 1, 0));
        assert!(warn_now(WARN_ROWS, 0));
        assert!(!warn_now(WARN_ROWS + 1, WARN_ROWS));
        assert!(!warn_now(2 * WARN_ROWS - 1, WARN_ROWS));
        assert!(warn_now(2 * WARN_ROWS, WARN_ROWS));
    }

    #[test]
    fn binary_payload_reads_back_exactly() {
        let bytes = [0xff, 0xfe, 0x00, b'a', 0x80];
        let row = serde_json::to_vec(&OutboxRecord::of("s", &message(&bytes), 5)).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&row).unwrap();
        assert_eq!(v["payload_base64"], "//4AYYA=");
        assert!(v.get("payload").is_none());
        let back = OutboxRecord::decode(&row).unwrap();
        assert_eq!(back.payload.bytes().unwrap(), bytes);
    }

    #[test]
    fn rows_of_the_first_layout_still_read() {
        let row = br#"{"v":1,"subscriber":"s","id":"m#0","topic":"labels","key":null,
            "headers":[["h","v"]],"written_at_ms":5,"payload":"{\"n\":1}"}"#;
        let r = OutboxRecord::decode(row).unwrap();
        assert_eq!(
            (r.subscriber.as_str(), r.id.as_str(), r.topic.as_str()),
            ("s", "m#0", "labels")
        );
        assert_eq!(r.key, None);
        assert_eq!(r.headers, vec![("h".to_string(), "v".to_string())]);
        assert_eq!(r.written_at_ms, 5);
        assert_eq!(r.payload.bytes().unwrap(), b"{\"n\":1}");
        let text = OutboxRecord::of("s", &message(b"{\"n\":1}"), 5);
        let v = serde_json::to_value(&text).unwrap();
        assert_eq!(
            v["payload"], "{\"n\":1}",
            "UTF-8 payloads keep the first layout"
        );
    }

    /// A stored row decodes to what was written, or a damaged one is refused; a row that
    /// decodes writes out as one that decodes to the same record.
    #[test]
    fn fuzz_outbox_rows_decode_or_are_refused() {
        use crate::fuzzing;
        use proptest::prelude::*;
        let valid =
            (fuzzing::bytes(40), ".{0,8}", any::<u64>()).prop_map(|(payload, topic, at)| {
                let m = OutboxMessage {
                    topic,
                    ..message(&payload)
                };
                serde_json::to_vec(&OutboxRecord::of("s", &m, at)).unwrap()
            });
        fuzzing::run("outbox_row", 2000, fuzzing::hostile(200, valid), |b| {
            if let Ok(r) = OutboxRecord::decode(&b) {
                fuzzing::decoded();
                r.payload.bytes().ok();
                let again = serde_json::to_vec(&r).unwrap();
                prop_assert_eq!(OutboxRecord::decode(&again).ok(), Some(r));
            }
            Ok(())
        });
    }
}
