//! From a Kafka record to an idempotency key and a routing hash.
//!
//! The record key is a partition key (ordering and routing), never an idempotency key:
//! the idempotency key comes from a header, a JSON pointer into the payload or CloudEvents
//! (structured: `source`/`id` in a JSON payload; binary: `ce_source`/`ce_id` headers).
//! The payload fingerprint is over the record's raw bytes: a Kafka redelivery is
//! byte-identical. Header values are bytes too: a key read from headers is hashed over
//! the raw bytes (its text, shown to operators and handlers, is `text_of` them), so two
//! ids that differ only in bytes that are not UTF-8 stay two messages.

use serde_json::Value;

use crate::config::{KeySource, SubscriberSettings};
use crate::envelope::{cloudevents_hash, key_hash, Envelope};
use crate::source::delivery::{Delivery, Payload, Target};
#[cfg(test)]
use crate::{
    envelope::IdempotencyKey,
    source::delivery::{key_delivery, Keying, RouteError},
};

/// The parts of a record key extraction looks at.
#[derive(Debug, Clone, Copy)]
pub struct RecordView<'a> {
    pub key: Option<&'a [u8]>,
    pub payload: &'a [u8],
    /// Header name and raw value, in record order (borrowed from the record: the consumer
    /// copies them once, into the delivery).
    pub headers: &'a [(&'a str, &'a [u8])],
}

/// A keyed record: idempotency key and entity (see `crate::envelope::derive_entity`).
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keyed {
    pub(crate) key: IdempotencyKey,
    pub(crate) entity: Option<String>,
    /// The record key as text (the job's partition key).
    pub(crate) partition_key: Option<String>,
}

/// The record as a delivery for `subscriber`: the record key is the partition key, header
/// values and the record key become text with `text_of`, the value is handed on as the
/// bytes sent (`Payload::Bytes`).
pub fn delivery(record: &RecordView<'_>, subscriber: Target) -> Delivery {
    let partition_key = record.key.filter(|k| !k.is_empty()).map(text_of);
    Delivery {
        key: partition_key,
        headers: record
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), text_of(v)))
            .collect(),
        ..Delivery::new(subscriber, Payload::Bytes(record.payload.to_vec()))
    }
}

/// Bytes as text, one way only: UTF-8 as it is; anything else as a NUL character followed
/// by the bytes in hex. A lossy decoding (every invalid byte read as U+FFFD) made two
/// record keys or header values that differ only in such bytes one entity, whose handler
/// state they then shared. A NUL never starts UTF-8 text a partition key may hold
/// ([`crate::envelope::derive_entity`] refuses it), so such a key is refused as an entity
/// with a reason instead of being merged with another.
pub(crate) fn text_of(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => {
            const DIGITS: &[u8; 16] = b"0123456789abcdef";
            let mut out = String::with_capacity(1 + 2 * bytes.len());
            out.push('\0');
            for b in bytes {
                out.push(DIGITS[usize::from(b >> 4)] as char);
                out.push(DIGITS[usize::from(b & 15)] as char);
            }
            out
        }
    }
}

/// Derives the idempotency key and routing hash of a record, or the reason it has none
/// (the record is then dead-lettered as `rejected`). The consumer routes records with
/// [`crate::source::delivery::route`], keyed the same way; the tests key records with this.
#[cfg(test)]
pub(crate) fn key_record(
    record: &RecordView<'_>,
    settings: &SubscriberSettings,
) -> Result<Keyed, RouteError> {
    let d = delivery(record, Target::Name(String::new()));
    let partition_key = d.key.clone();
    let hash = |env: &Envelope, s: &SubscriberSettings| raw_header_key_hash(record, env, s);
    let keys = key_delivery(d, settings, Keying::DeriveThen(&hash))?;
    Ok(Keyed {
        key: keys.key,
        entity: keys.entity,
        partition_key,
    })
}

/// The value of the last header named `name`, as sent.
fn raw_header<'a>(record: &RecordView<'a>, name: &str) -> Option<&'a [u8]> {
    record
        .headers
        .iter()
        .rev()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
}

/// The key hash over the raw header bytes when the key came from headers (`derive_key` saw
/// them decoded lossily, where every invalid byte reads as U+FFFD). For UTF-8 values it is
/// the hash `derive_key` computed, so claims stored before this stay matched.
pub fn raw_header_key_hash(
    record: &RecordView<'_>,
    env: &Envelope,
    settings: &SubscriberSettings,
) -> Option<u128> {
    match &settings.key {
        KeySource::Header { name } => raw_header(record, name).map(key_hash),
        KeySource::Cloudevents => {
            // Structured mode (both in the payload) wins in `derive_key`; then the
            // key did not come from headers.
            let structured = ["source", "id"]
                .iter()
                .all(|f| env.payload.get(f).and_then(Value::as_str).is_some());
            if structured {
                return None;
            }
            Some(cloudevents_hash(
                raw_header(record, "ce_source")?,
                raw_header(record, "ce_id")?,
            ))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PartitionSource;
    use crate::envelope::cloudevents_key;

    fn settings(key: KeySource) -> SubscriberSettings {
        SubscriberSettings {
            key,
            ..SubscriberSettings::default()
        }
    }

    fn headers<'a>(pairs: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a [u8])> {
        pairs.iter().map(|(k, v)| (*k, v.as_bytes())).collect()
    }

    #[test]
    fn header_key_ignores_record_key() {
        let h = headers(&[("message-id", "m-1")]);
        let rec = RecordView {
            key: Some(b"o-1"),
            payload: b"not json",
            headers: &h,
        };
        let s = settings(KeySource::Header {
            name: "message-id".into(),
        });
        let k = key_record(&rec, &s).expect("keyed");
        assert_eq!(k.key.text, "m-1");
        assert_eq!(k.partition_key.as_deref(), Some("o-1"));
        assert_eq!(k.entity, None, "no entity by default");
    }

    #[test]
    fn record_key_routes_when_asked() {
        let h = headers(&[("message-id", "m-1")]);
        let rec = RecordView {
            key: Some(b"o-1"),
            payload: b"{}",
            headers: &h,
        };
        let mut s = settings(KeySource::Header {
            name: "message-id".into(),
        });
        s.partition_key = PartitionSource::EnvelopeKey;
        assert_eq!(
            key_record(&rec, &s).expect("keyed").entity.as_deref(),
            Some("o-1")
        );
    }

    #[test]
    fn json_pointer_key_reads_payload() {
        let rec = RecordView {
            key: None,
            payload: br#"{"order":{"id":"A-7"}}"#,
            headers: &[],
        };
        let s = settings(KeySource::JsonPointer {
            pointer: "/order/id".into(),
            pointers: vec![],
        });
        assert_eq!(key_record(&rec, &s).expect("keyed").key.text, "A-7");
    }

    #[test]
    fn cloudevents_structured_and_binary_agree() {
        let s = settings(KeySource::Cloudevents);
        let structured = RecordView {
            key: None,
            payload: br#"{"specversion":"1.0","source":"/shop","id":"E1","data":{}}"#,
            headers: &[],
        };
        let h = headers(&[("ce_source", "/shop"), ("ce_id", "E1")]);
        let binary = RecordView {
            key: None,
            payload: b"\x00binary data",
            headers: &h,
        };
        let a = key_record(&structured, &s).expect("structured");
        let b = key_record(&binary, &s).expect("binary");
        assert_eq!(a.key, b.key);
        assert_eq!(a.key, cloudevents_key("/shop", "E1"));
    }

    #[test]
    fn header_ids_differing_only_in_invalid_utf8_are_distinct() {
        let s = settings(KeySource::Header {
            name: "message-id".into(),
        });
        let a: Vec<(&str, &[u8])> = vec![("message-id", b"m-\xff\x01")];
        let b: Vec<(&str, &[u8])> = vec![("message-id", b"m-\xfe\x01")];
        let key = |h: &[(&str, &[u8])]| {
            let rec = RecordView {
                key: None,
                payload: b"{}",
                headers: h,
            };
            key_record(&rec, &s).expect("keyed").key
        };
        let (ka, kb) = (key(&a), key(&b));
        assert_ne!(ka.hash, kb.hash, "two messages would share one claim");
        assert_eq!(ka.hash, key_hash(b"m-\xff\x01"), "the raw bytes are hashed");
        // A UTF-8 id hashes as before: claims stored by earlier releases still match.
        let text = headers(&[("message-id", "m-1")]);
        assert_eq!(key(&text).hash, key_hash(b"m-1"));
    }

    /// Two record keys that differ only in bytes that are not UTF-8 were one entity (both
    /// decoded to the same U+FFFD text) and shared their handler state; now such keys are
    /// refused as entities, and the text of any bytes is theirs alone.
    #[test]
    fn record_keys_differing_only_in_invalid_utf8_are_not_one_entity() {
        let h = headers(&[("message-id", "m-1")]);
        let mut s = settings(KeySource::Header {
            name: "message-id".into(),
        });
        s.partition_key = PartitionSource::EnvelopeKey;
        let keyed = |key: &'static [u8]| {
            let rec = RecordView {
                key: Some(key),
                payload: b"{}",
                headers: &h,
            };
            key_record(&rec, &s)
        };
        for key in [b"o-\xff".as_slice(), b"o-\xfe"] {
            let err = keyed(key).expect_err("a key that is not text is no entity");
            assert!(err.to_string().contains("not UTF-8"), "{err}");
        }
        assert_eq!(keyed(b"o-1").expect("keyed").entity.as_deref(), Some("o-1"));
        assert_ne!(text_of(b"o-\xff"), text_of(b"o-\xfe"));
        assert_eq!(text_of(b"o-\xff"), "\u{0}6f2dff");
        assert_eq!(text_of("o-\u{fffd}".as_bytes()), "o-\u{fffd}");
    }

    #[test]
    fn binary_cloudevents_ids_differing_only_in_invalid_utf8_are_distinct() {
        let s = settings(KeySource::Cloudevents);
        let key = |id: &[u8]| {
            let h: Vec<(&str, &[u8])> = vec![("ce_source", b"/shop"), ("ce_id", id)];
            let rec = RecordView {
                key: None,
                payload: b"\x00binary data",
                headers: &h,
            };
            key_record(&rec, &s).expect("keyed").key
        };
        assert_ne!(key(b"E\xff").hash, key(b"E\xfe").hash);
        assert_eq!(key(b"E1"), cloudevents_key("/shop", "E1"));
    }

    #[test]
    fn missing_key_is_a_reason_not_a_panic() {
        let s = settings(KeySource::Header {
            name: "message-id".into(),
        });
        let rec = RecordView {
            key: None,
            payload: b"",
            headers: &[],
        };
        let reason = key_record(&rec, &s).unwrap_err();
        assert!(reason.to_string().contains("message-id"), "{reason}");
        let s = settings(KeySource::JsonPointer {
            pointer: "/id".into(),
            pointers: vec![],
        });
        let garbage = RecordView {
            key: None,
            payload: b"\xff\xfe not json",
            headers: &[],
        };
        assert!(key_record(&garbage, &s)
            .unwrap_err()
            .to_string()
            .contains("/id"));
    }
}

/// Fuzz target (see `crate::fuzzing`): records with any key, value and header bytes.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::config::PartitionSource;
    use crate::fuzzing;

    /// Record values: structured CloudEvents and other JSON, mutated, or any bytes.
    fn value() -> impl Strategy<Value = Vec<u8>> {
        let event = (".{0,8}", ".{0,8}", fuzzing::json()).prop_map(|(source, id, data)| {
            serde_json::to_vec(&json!({ "source": source, "id": id, "data": data }))
                .unwrap_or_default()
        });
        let other = fuzzing::json().prop_map(|v| serde_json::to_vec(&v).unwrap_or_default());
        fuzzing::hostile(200, prop_oneof![event, other])
    }

    fn settings() -> impl Strategy<Value = SubscriberSettings> {
        let key = prop_oneof![
            Just(KeySource::Header {
                name: "x-id".into()
            }),
            Just(KeySource::Cloudevents),
            Just(KeySource::JsonPointer {
                pointer: "/data/order_id".into(),
                pointers: Vec::new()
            }),
            Just(KeySource::ContentHash),
            Just(KeySource::Id),
        ];
        let partition = prop_oneof![
            Just(PartitionSource::IdempotencyKey),
            Just(PartitionSource::EnvelopeKey),
            Just(PartitionSource::Header {
                name: "x-id".into()
            }),
            Just(PartitionSource::JsonPointer {
                pointer: "/id".into()
            }),
        ];
        let max_key_bytes = prop_oneof![Just(1024usize), 1usize..16];
        (key, partition, max_key_bytes).prop_map(|(key, partition_key, max_key_bytes)| {
            SubscriberSettings {
                key,
                partition_key,
                max_key_bytes,
                ..SubscriberSettings::default()
            }
        })
    }

    /// A keyed record's key is within its limit, deterministic, and for a header key the
    /// hash of the last such header's raw bytes (so invalid UTF-8 still tells ids apart).
    #[test]
    fn fuzz_kafka_records_key_or_are_refused() {
        let header = ("x-id|ce_id|ce_source|.{0,3}", fuzzing::bytes(12));
        let record = (
            prop::option::of(fuzzing::bytes(12)),
            value(),
            prop::collection::vec(header, 0..5),
            settings(),
        );
        fuzzing::run(
            "kafka_record",
            3000,
            record,
            |(key, payload, headers, s)| {
                let headers: Vec<(&str, &[u8])> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_slice()))
                    .collect();
                let view = RecordView {
                    key: key.as_deref(),
                    payload: &payload,
                    headers: &headers,
                };
                let keyed = key_record(&view, &s).map_err(|e| e.to_string());
                prop_assert_eq!(&keyed, &key_record(&view, &s).map_err(|e| e.to_string()));
                if let Ok(k) = keyed {
                    fuzzing::decoded();
                    prop_assert!(k.key.text.len() <= s.max_key_bytes);
                    if let KeySource::Header { name } = &s.key {
                        let raw = raw_header(&view, name).unwrap_or_default();
                        prop_assert_eq!(k.key.hash, key_hash(raw));
                    }
                    let given = key.filter(|k| !k.is_empty());
                    prop_assert_eq!(k.partition_key, given.map(|k| text_of(&k)));
                }
                Ok(())
            },
        );
    }
}
