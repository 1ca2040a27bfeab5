//! The stored layout of quarantine and dead-letter records: typed records with the field
//! names of the first layout (so existing data directories read unchanged), payloads as
//! text or base64, and the key and fingerprint a repeat of the same message is merged by.
//! How records are stored, merged, capped and swept is in `records/mod.rs`.

use serde::{Deserialize, Serialize};

use crate::effects::Failure;
use crate::ledger::shard::SubState;
use crate::ledger::{Job, SubscriberId};

fn one() -> u64 {
    1
}

/// A payload as records keep it: text when it is UTF-8, else base64.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub(crate) struct StoredPayload {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) payload: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) payload_base64: Option<String>,
}

impl StoredPayload {
    pub(crate) fn of(bytes: &[u8]) -> Self {
        use base64::Engine as _;
        match std::str::from_utf8(bytes) {
            Ok(text) => StoredPayload {
                payload: Some(text.to_string()),
                payload_base64: None,
            },
            Err(_) => StoredPayload {
                payload: None,
                payload_base64: Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
            },
        }
    }

    /// The payload's bytes as they were given to [`StoredPayload::of`].
    pub(crate) fn bytes(&self) -> Result<Vec<u8>, StoredRecordError> {
        use base64::Engine as _;
        match (&self.payload, &self.payload_base64) {
            (_, Some(b64)) => Ok(base64::engine::general_purpose::STANDARD.decode(b64)?),
            (Some(text), None) => Ok(text.clone().into_bytes()),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// Why a stored record (an outbox row, a payload in it) cannot be read back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum StoredRecordError {
    #[error("payload_base64 is not base64: {0}")]
    Base64(#[from] base64::DecodeError),
    /// The row is not the JSON of its record.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// A message with a known id and another payload than the one claimed (G4). Field names
/// are those of the first layout, so existing data directories read unchanged; `count`,
/// `stored_at_ms` and `last_seen_ms` came later and default when absent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct QuarantineRecord {
    pub(crate) v: u32,
    pub(crate) subscriber: String,
    pub(crate) id: String,
    pub(crate) key_hash: String,
    pub(crate) stored_fingerprint: String,
    /// The quarantined payload's fingerprint; with `key_hash`, what repeats are merged by.
    pub(crate) fingerprint: String,
    pub(crate) reason: String,
    pub(crate) received_at_ms: u64,
    pub(crate) key: Option<String>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) origin: Option<String>,
    #[serde(flatten)]
    pub(crate) payload: StoredPayload,
    /// Deliveries this record stands for.
    #[serde(default = "one")]
    pub(crate) count: u64,
    #[serde(default)]
    pub(crate) stored_at_ms: u64,
    #[serde(default)]
    pub(crate) last_seen_ms: u64,
}

/// A message whose handler gave up. Same compatibility rules as [`QuarantineRecord`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct DeadLetterRecord {
    pub(crate) v: u32,
    pub(crate) subscriber: String,
    pub(crate) id: String,
    pub(crate) key_hash: String,
    /// The payload's fingerprint; with `key_hash`, what repeats are merged by.
    #[serde(default)]
    pub(crate) fingerprint: String,
    /// Failure kind (`Failure::kind`).
    pub(crate) kind: String,
    pub(crate) reason: String,
    pub(crate) attempts: u32,
    pub(crate) received_at_ms: u64,
    pub(crate) failed_at_ms: u64,
    pub(crate) key: Option<String>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) origin: Option<String>,
    #[serde(flatten)]
    pub(crate) payload: StoredPayload,
    #[serde(default = "one")]
    pub(crate) count: u64,
    #[serde(default)]
    pub(crate) stored_at_ms: u64,
    #[serde(default)]
    pub(crate) last_seen_ms: u64,
}

/// A record on its way into a table, with what repeats are merged by.
#[derive(Debug)]
pub(crate) struct PendingRecord {
    pub(crate) sub: SubscriberId,
    pub(crate) key: u128,
    pub(crate) fingerprint: u64,
    pub(crate) at_ms: u64,
    /// The hash its message was routed by (see [`crate::ledger::changelog::RecordCopy`]).
    pub(crate) route: u128,
    /// The encoded record, `count` 1.
    pub(crate) body: Vec<u8>,
}

/// The hash `job` was routed to its shard by, under its placement.
fn route_of(st: &SubState, job: &Job) -> u128 {
    use crate::ledger::Placement;
    match job.placement {
        Placement::ByKey => job.key,
        Placement::Subscriber => crate::envelope::key_hash(st.name.as_bytes()),
        Placement::Entity => {
            crate::envelope::key_hash(job.entity.as_deref().unwrap_or_default().as_bytes())
        }
    }
}

/// The quarantine record of `job`, which conflicts with a claim of `stored_fingerprint`.
pub(crate) fn quarantine(
    st: &SubState,
    job: &Job,
    stored_fingerprint: u64,
    now: u64,
) -> PendingRecord {
    let record = QuarantineRecord {
        v: 1,
        subscriber: st.name.to_string(),
        id: job.id.to_string(),
        key_hash: format!("{:032x}", job.key),
        stored_fingerprint: format!("{stored_fingerprint:016x}"),
        fingerprint: format!("{:016x}", job.fingerprint),
        reason: "same id, different payload".into(),
        received_at_ms: job.received_at_ms,
        key: job.partition_key.clone(),
        headers: job.headers.clone(),
        origin: job.origin.as_ref().map(ToString::to_string),
        payload: StoredPayload::of(&job.payload),
        count: 1,
        stored_at_ms: now,
        last_seen_ms: now,
    };
    PendingRecord {
        sub: st.id,
        key: job.key,
        fingerprint: job.fingerprint,
        at_ms: now,
        route: route_of(st, job),
        body: serde_json::to_vec(&record).unwrap_or_default(),
    }
}

/// The dead-letter record of `job`, whose handler failed with `failure`.
pub(crate) fn dead_letter(
    st: &SubState,
    job: &Job,
    failure: &Failure,
    reason: &str,
    now: u64,
) -> PendingRecord {
    let record = DeadLetterRecord {
        v: 1,
        subscriber: st.name.to_string(),
        id: job.id.to_string(),
        key_hash: format!("{:032x}", job.key),
        fingerprint: format!("{:016x}", job.fingerprint),
        kind: failure.kind().into(),
        reason: reason.into(),
        attempts: job.attempt,
        received_at_ms: job.received_at_ms,
        failed_at_ms: now,
        key: job.partition_key.clone(),
        headers: job.headers.clone(),
        origin: job.origin.as_ref().map(ToString::to_string),
        payload: StoredPayload::of(&job.payload),
        count: 1,
        stored_at_ms: now,
        last_seen_ms: now,
    };
    PendingRecord {
        sub: st.id,
        key: job.key,
        fingerprint: job.fingerprint,
        at_ms: now,
        route: route_of(st, job),
        body: serde_json::to_vec(&record).unwrap_or_default(),
    }
}

/// A dead letter for input that never became a job. `record` is the source's JSON object
/// (reason, payload, origin...). Repeats are merged by the message id (if the input had
/// one) and a fingerprint of its reason and payload, so a changing origin (a Kafka
/// offset) does not make every redelivery a record of its own.
pub(crate) fn unusable_input(
    sub: SubscriberId,
    subscriber: &str,
    record: serde_json::Value,
    now: u64,
) -> Result<PendingRecord, serde_json::Error> {
    let mut record = match record {
        serde_json::Value::Object(m) => serde_json::Value::Object(m),
        other => serde_json::json!({ "detail": other }),
    };
    let key = merge_key(
        record.get("key_hash").and_then(|v| v.as_str()),
        record.get("id").and_then(|v| v.as_str()),
    );
    let what = serde_json::to_vec(&(
        record.get("reason"),
        record.get("payload"),
        record.get("payload_base64"),
        record.get("detail"),
    ))?;
    let fingerprint = crate::envelope::fingerprint(&what);
    record["v"] = 1.into();
    record["subscriber"] = subscriber.into();
    record["fingerprint"] = format!("{fingerprint:016x}").into();
    record["failed_at_ms"] = now.into();
    record["count"] = 1.into();
    record["stored_at_ms"] = now.into();
    record["last_seen_ms"] = now.into();
    Ok(PendingRecord {
        sub,
        key,
        fingerprint,
        at_ms: now,
        // Records of input without a key live on the subscriber name's shard.
        route: crate::envelope::key_hash(subscriber.as_bytes()),
        body: serde_json::to_vec(&record)?,
    })
}

/// Adds `count` 1 and `last_seen_ms` to a record stored before they existed, so every
/// listing shows them.
pub(crate) fn with_defaults(mut body: serde_json::Value) -> serde_json::Value {
    if let Some(o) = body.as_object_mut() {
        o.entry("count").or_insert(1.into());
        if !o.contains_key("last_seen_ms") {
            let at = ["failed_at_ms", "received_at_ms"]
                .iter()
                .find_map(|k| o.get(*k).and_then(|v| v.as_u64()))
                .unwrap_or(0);
            o.insert("last_seen_ms".into(), at.into());
        }
    }
    body
}

/// The key a record is merged under: its `key_hash` (hex) if it has one, else a hash of its
/// message id (empty for input that had none). Used when storing and when unindexing.
pub(super) fn merge_key(key_hash: Option<&str>, id: Option<&str>) -> u128 {
    key_hash
        .and_then(|h| u128::from_str_radix(h, 16).ok())
        .unwrap_or_else(|| crate::envelope::key_hash(id.unwrap_or("").as_bytes()))
}

pub(super) fn text(v: &Option<serde_json::Value>) -> Option<&str> {
    v.as_ref().and_then(|v| v.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_layout_records_read_with_count_one() {
        let old = serde_json::json!({
            "v": 1, "subscriber": "s", "id": "a", "key_hash": "00", "stored_fingerprint": "01",
            "fingerprint": "02", "reason": "same id, different payload", "received_at_ms": 5,
            "key": null, "headers": [], "origin": null, "payload": "two"
        });
        let r: QuarantineRecord = serde_json::from_value(old.clone()).expect("record");
        assert_eq!(r.count, 1);
        assert_eq!(r.payload.payload.as_deref(), Some("two"));
        let shown = with_defaults(old);
        assert_eq!(shown["count"], 1);
        assert_eq!(shown["last_seen_ms"], 5);
    }

    #[test]
    fn records_keep_the_first_layout_field_names() {
        let r = DeadLetterRecord {
            v: 1,
            subscriber: "s".into(),
            id: "a".into(),
            key_hash: "00".into(),
            fingerprint: "02".into(),
            kind: "permanent".into(),
            reason: "no".into(),
            attempts: 1,
            received_at_ms: 1,
            failed_at_ms: 2,
            key: None,
            headers: vec![("h".into(), "v".into())],
            origin: None,
            payload: StoredPayload::of(&[0xff, 0]),
            count: 3,
            stored_at_ms: 2,
            last_seen_ms: 4,
        };
        let v = serde_json::to_value(&r).expect("json");
        assert_eq!(v["payload_base64"], "/wA=");
        assert!(v.get("payload").is_none());
        assert_eq!(v["headers"], serde_json::json!([["h", "v"]]));
        assert_eq!(v["key"], serde_json::Value::Null);
        let back: DeadLetterRecord = serde_json::from_value(v).expect("back");
        assert_eq!(back, r);
    }
}
