//! Decoding input envelopes and deriving idempotency keys and payload fingerprints.
//!
//! The key names the logical event; the fingerprint names its content. Same key with the
//! same fingerprint is a duplicate; same key with another fingerprint is quarantined (G4).

use std::borrow::Cow;

use std::collections::BTreeMap;

use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use crate::config::{FingerprintSpec, KeySource, PartitionSource, SubscriberSettings};

mod pick;
pub use pick::pick;

/// A message as key sources read it, whatever source it came from: the parts a key, a
/// fingerprint or an entity may be derived from (built by [`crate::source::delivery::route`]).
#[derive(Debug, Clone, Default)]
pub struct Envelope {
    /// The producer's message id.
    pub(crate) id: Option<String>,
    /// Partition key (routing and ordering), not an idempotency key.
    pub(crate) key: Option<String>,
    /// String headers (`ce_id`, `ce_source`, or any header a key source names).
    pub(crate) headers: BTreeMap<String, String>,
    /// The message body.
    pub(crate) payload: Value,
}

/// A derived idempotency key: its text (shown to operators) and its 128-bit hash (stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    pub text: String,
    pub hash: u128,
}

impl IdempotencyKey {
    /// Hashes a plain id. With 128 bits the chance of any collision stays below 1e-18 at
    /// 1e10 keys, so the hash alone identifies a claim.
    pub(crate) fn from_id(text: &str) -> Self {
        IdempotencyKey {
            hash: key_hash(text.as_bytes()),
            text: text.to_string(),
        }
    }
}

/// The stored hash of a key's bytes.
#[inline]
pub fn key_hash(bytes: &[u8]) -> u128 {
    xxh3_128(bytes)
}

/// The payload fingerprint stored with a claim.
#[inline]
pub fn fingerprint(payload: &[u8]) -> u64 {
    xxh3_64(payload)
}

/// The fingerprint of a payload under a subscriber's `fingerprint` setting: of `bytes`
/// when it ignores nothing, else of the canonical JSON with the ignored pointers removed
/// (`json` when the caller parsed it already — taken, not copied —, else `bytes` parsed;
/// bytes that are not JSON have nothing to ignore and are fingerprinted as they are).
pub(crate) fn payload_fingerprint(bytes: &[u8], json: Value, spec: &FingerprintSpec) -> u64 {
    if spec.ignore.is_empty() {
        return fingerprint(bytes);
    }
    let mut value = if json.is_null() {
        match serde_json::from_slice::<Value>(bytes) {
            Ok(v) => v,
            Err(_) => return fingerprint(bytes),
        }
    } else {
        json
    };
    for pointer in &spec.ignore {
        remove_pointer(&mut value, pointer);
    }
    fingerprint(&canonical_payload(&value))
}

/// Removes what a JSON pointer (RFC 6901) names: an object member, or an array element
/// (replaced by `null`, so later indexes keep their meaning). Nothing when it names nothing.
fn remove_pointer(value: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let last = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.remove(&last);
        }
        Some(Value::Array(items)) => {
            if let Some(item) = last.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                *item = Value::Null;
            }
        }
        _ => {}
    }
}

/// The JSON pointers the settings' key sources read in a payload (none when they read none
/// of it), without collecting them: this runs for every message.
fn read_pointers(settings: &SubscriberSettings) -> impl Iterator<Item = &str> + Clone {
    let (one, many): (Option<&str>, &[String]) = match &settings.key {
        KeySource::JsonPointer { pointer, pointers } if pointers.is_empty() => {
            (Some(pointer.as_str()), &[])
        }
        KeySource::JsonPointer { pointers, .. } => (None, pointers.as_slice()),
        KeySource::Id
        | KeySource::Header { .. }
        | KeySource::Cloudevents
        | KeySource::ContentHash => (None, &[]),
    };
    let cloudevents: &[&str] = match settings.key {
        KeySource::Cloudevents => &["/source", "/id"],
        _ => &[],
    };
    let entity = match &settings.partition_key {
        PartitionSource::JsonPointer { pointer } => Some(pointer.as_str()),
        _ => None,
    };
    one.into_iter()
        .chain(many.iter().map(String::as_str))
        .chain(cloudevents.iter().copied())
        .chain(entity)
}

/// The JSON a subscriber's settings read in a payload of raw bytes: nothing (`Null`) when
/// no key source reads the payload; only the members the key sources' pointers name
/// ([`pick`]) when the fingerprint is of the bytes; the whole document when the
/// fingerprint removes members from it. `Null` for bytes that are not one JSON document.
pub(crate) fn payload_json(bytes: &[u8], settings: &SubscriberSettings) -> Value {
    let pointers = read_pointers(settings);
    if pointers.clone().next().is_none() {
        Value::Null
    } else if settings.fingerprint.ignore.is_empty() {
        pick(bytes, pointers).unwrap_or(Value::Null)
    } else {
        serde_json::from_slice(bytes).unwrap_or(Value::Null)
    }
}

/// Why a message cannot be keyed; becomes the `reason` of a `rejected` outcome.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    #[error("no idempotency key: {0}")]
    Missing(String),
    #[error("idempotency key is {len} bytes, the limit is {limit}")]
    Oversized { len: usize, limit: usize },
}

/// Canonical bytes of a payload: compact JSON with object keys sorted, so re-encoding the
/// same event (whitespace, key order) does not read as a different payload.
///
/// Numbers are kept as written, every digit (serde_json's `arbitrary_precision`): the
/// bytes are also what handlers get and what quarantine records keep, so they must not
/// round a number through `f64`. Two spellings of one value (`1.0` and `1.00`, `1e2` and
/// `100`) are therefore different payloads: a re-encoding that respells a number reads
/// as a mismatch and is quarantined, never dropped as a duplicate.
pub fn canonical_payload(payload: &Value) -> Vec<u8> {
    // serde_json's default map is ordered by key, and to_vec never fails for a Value.
    serde_json::to_vec(payload).unwrap_or_default()
}

/// The key text at `pointer`: a non-empty string, or a number's text.
fn pointer_text<'a>(payload: &'a Value, pointer: &str) -> Result<Cow<'a, str>, KeyError> {
    match payload.pointer(pointer) {
        Some(Value::String(s)) if !s.is_empty() => Ok(Cow::Borrowed(s)),
        Some(Value::Number(n)) => Ok(Cow::Owned(n.to_string())),
        Some(other) if !other.is_null() && !matches!(other, Value::String(_)) => Err(
            KeyError::Missing(format!("payload at `{pointer}` is not a string or number")),
        ),
        _ => Err(KeyError::Missing(format!(
            "payload has nothing at `{pointer}`"
        ))),
    }
}

/// Derives the idempotency key of an envelope under a subscriber's settings.
pub(crate) fn derive_key(
    env: &Envelope,
    canonical: &[u8],
    settings: &SubscriberSettings,
) -> Result<IdempotencyKey, KeyError> {
    let key = match &settings.key {
        KeySource::Id => match env.id.as_deref() {
            Some(id) if !id.is_empty() => IdempotencyKey::from_id(id),
            Some(_) => return Err(KeyError::Missing("field `id` is empty".into())),
            None => return Err(KeyError::Missing("field `id` is missing".into())),
        },
        KeySource::Header { name } => match env.headers.get(name) {
            Some(v) if !v.is_empty() => IdempotencyKey::from_id(v),
            _ => return Err(KeyError::Missing(format!("header `{name}` is missing"))),
        },
        KeySource::JsonPointer { pointer, pointers } if pointers.is_empty() => {
            IdempotencyKey::from_id(&pointer_text(&env.payload, pointer)?)
        }
        KeySource::JsonPointer { pointers, .. } => {
            // A JSON array of the parts: unambiguous whatever the parts hold
            // (["a,b","c"] and ["a","b,c"] differ), and readable in records.
            let parts = pointers
                .iter()
                .map(|p| pointer_text(&env.payload, p).map(|t| Value::String(t.into_owned())))
                .collect::<Result<Vec<_>, _>>()?;
            IdempotencyKey::from_id(&Value::Array(parts).to_string())
        }
        KeySource::Cloudevents => {
            let from_payload = (
                env.payload.get("source").and_then(Value::as_str),
                env.payload.get("id").and_then(Value::as_str),
            );
            let (source, id) =
                match from_payload {
                    (Some(s), Some(i)) => (s, i),
                    _ => match (env.headers.get("ce_source"), env.headers.get("ce_id")) {
                        (Some(s), Some(i)) => (s.as_str(), i.as_str()),
                        _ => return Err(KeyError::Missing(
                            "CloudEvents `source` and `id` are missing (payload or ce_ headers)"
                                .into(),
                        )),
                    },
                };
            if source.is_empty() || id.is_empty() {
                return Err(KeyError::Missing(
                    "CloudEvents `source` or `id` is empty".into(),
                ));
            }
            cloudevents_key(source, id)
        }
        KeySource::ContentHash => {
            // xxh3-128 of the canonical payload; the text names the hash it shows.
            let h = xxh3_128(canonical);
            IdempotencyKey {
                text: format!("xxh3:{h:032x}"),
                hash: h,
            }
        }
    };
    if key.text.len() > settings.max_key_bytes {
        return Err(KeyError::Oversized {
            len: key.text.len(),
            limit: settings.max_key_bytes,
        });
    }
    Ok(key)
}

/// The entity a message belongs to: the text of the subscriber's configured partition key,
/// or `None` when it configures none (the default). A handler subscriber with an entity
/// runs each entity's messages on one shard and scopes its state to the entity
/// (`ledger/placement.rs`); without a handler the entity is not used for routing.
pub(crate) fn derive_entity<'e>(
    env: &'e Envelope,
    settings: &SubscriberSettings,
) -> Result<Option<Cow<'e, str>>, KeyError> {
    // Borrowed: a subscriber without a handler only checks it.
    let text: Option<Cow<'e, str>> = match &settings.partition_key {
        PartitionSource::IdempotencyKey => return Ok(None),
        PartitionSource::EnvelopeKey => env.key.as_deref().map(Cow::Borrowed),
        PartitionSource::Header { name } => {
            env.headers.get(name).map(|v| Cow::Borrowed(v.as_str()))
        }
        PartitionSource::JsonPointer { pointer } => match env.payload.pointer(pointer) {
            Some(Value::String(s)) => Some(Cow::Borrowed(s.as_str())),
            Some(Value::Number(n)) => Some(Cow::Owned(n.to_string())),
            _ => None,
        },
    };
    match text {
        // The NUL byte separates an entity from the keys in its state scope.
        Some(t) if t.contains('\0') => Err(KeyError::Missing(format!(
            "partition key ({:?}) contains a NUL character or bytes that are not UTF-8; an entity key must be text",
            settings.partition_key
        ))),
        Some(t) if t.len() > settings.max_key_bytes => Err(KeyError::Oversized {
            len: t.len(),
            limit: settings.max_key_bytes,
        }),
        Some(t) if !t.is_empty() => Ok(Some(t)),
        _ => Err(KeyError::Missing(format!(
            "no partition key ({:?})",
            settings.partition_key
        ))),
    }
}

/// CloudEvents identity is the pair (source, id); the hash covers both with a length
/// prefix so `("a#b","c")` and `("a","b#c")` stay distinct.
pub fn cloudevents_key(source: &str, id: &str) -> IdempotencyKey {
    IdempotencyKey {
        text: format!("{source}#{id}"),
        hash: cloudevents_hash(source.as_bytes(), id.as_bytes()),
    }
}

/// The stored hash of a CloudEvents identity, over raw bytes (binary-mode headers need not
/// be UTF-8).
pub(crate) fn cloudevents_hash(source: &[u8], id: &[u8]) -> u128 {
    let mut buf = Vec::with_capacity(source.len() + id.len() + 8);
    buf.extend_from_slice(&(source.len() as u64).to_le_bytes());
    buf.extend_from_slice(source);
    buf.extend_from_slice(id);
    xxh3_128(&buf)
}

#[cfg(test)]
mod tests {

    fn ignoring(pointers: &[&str]) -> FingerprintSpec {
        FingerprintSpec {
            ignore: pointers.iter().map(|p| p.to_string()).collect(),
        }
    }

    fn fp(payload: &str, spec: &FingerprintSpec) -> u64 {
        let bytes = payload.as_bytes();
        payload_fingerprint(bytes, Value::Null, spec)
    }

    #[test]
    fn ignored_pointers_leave_the_fingerprint() {
        let spec = ignoring(&["/sent_at", "/meta/trace_id", "/a~1b", "/items/1"]);
        let a = r#"{"order":1,"sent_at":"10:00","meta":{"trace_id":"t1","v":2},"a/b":1,"items":[1,2,3]}"#;
        let b = r#"{"items":[1,9,3],"a/b":7,"meta":{"v":2,"trace_id":"t2"},"sent_at":"10:05","order":1}"#;
        assert_eq!(fp(a, &spec), fp(b, &spec));
        // Anything else still counts: another order, another meta.v, another item 0.
        for other in [
            r#"{"order":2,"sent_at":"10:00","meta":{"trace_id":"t1","v":2},"a/b":1,"items":[1,2,3]}"#,
            r#"{"order":1,"sent_at":"10:00","meta":{"trace_id":"t1","v":3},"a/b":1,"items":[1,2,3]}"#,
            r#"{"order":1,"sent_at":"10:00","meta":{"trace_id":"t1","v":2},"a/b":1,"items":[0,2,3]}"#,
        ] {
            assert_ne!(fp(a, &spec), fp(other, &spec), "{other}");
        }
        // Without the setting every byte counts (and the parsed value gives the same answer).
        let none = FingerprintSpec::default();
        assert_ne!(fp(a, &none), fp(b, &none));
        let parsed: Value = serde_json::from_str(a).unwrap();
        assert_eq!(
            payload_fingerprint(&canonical_payload(&parsed), parsed.clone(), &spec),
            fp(a, &spec)
        );
    }

    #[test]
    fn a_missing_pointer_or_a_payload_that_is_not_json_is_fingerprinted_as_it_is() {
        let spec = ignoring(&["/nope/deeper", "/x"]);
        assert_eq!(fp(r#"{"a":1}"#, &spec), fingerprint(br#"{"a":1}"#));
        assert_eq!(fp("not json", &spec), fingerprint(b"not json"));
    }

    use super::*;
    use crate::source::pipe_line::PipeLine;
    use serde_json::json;

    fn env(v: Value) -> Envelope {
        serde_json::from_value::<PipeLine>(v)
            .map(Envelope::from)
            .expect("envelope")
    }

    fn settings(key: KeySource) -> SubscriberSettings {
        SubscriberSettings {
            key,
            ..SubscriberSettings::default()
        }
    }

    #[test]
    fn id_key_is_stable() {
        let e = env(json!({"id": "evt-1", "payload": {"a": 1}}));
        let k1 = derive_key(&e, b"", &settings(KeySource::Id)).expect("key");
        let k2 = derive_key(&e, b"", &settings(KeySource::Id)).expect("key");
        assert_eq!(k1, k2);
        assert_eq!(k1.text, "evt-1");
    }

    #[test]
    fn missing_id_is_rejected() {
        let e = env(json!({"payload": {}}));
        let err = derive_key(&e, b"", &settings(KeySource::Id)).unwrap_err();
        assert!(matches!(err, KeyError::Missing(_)));
    }

    #[test]
    fn oversized_key_is_rejected() {
        let long = "x".repeat(1025);
        let e = env(json!({ "id": long }));
        let err = derive_key(&e, b"", &settings(KeySource::Id)).unwrap_err();
        assert_eq!(
            err,
            KeyError::Oversized {
                len: 1025,
                limit: 1024
            }
        );
        let exact = env(json!({ "id": "x".repeat(1024) }));
        assert!(derive_key(&exact, b"", &settings(KeySource::Id)).is_ok());
    }

    #[test]
    fn json_pointer_key_reads_payload() {
        let e = env(json!({"payload": {"order": {"id": 42}}}));
        let s = settings(KeySource::JsonPointer {
            pointer: "/order/id".into(),
            pointers: vec![],
        });
        assert_eq!(derive_key(&e, b"", &s).expect("key").text, "42");
        let missing = env(json!({"payload": {"order": {}}}));
        assert!(derive_key(&missing, b"", &s).is_err());
    }

    /// A composite key is the parts together: the same parts give the same key, another
    /// tenant with the same order id another key, and parts holding the separator cannot
    /// collide with other parts.
    #[test]
    fn composite_json_pointer_key_joins_its_parts_unambiguously() {
        let s = settings(KeySource::JsonPointer {
            pointer: String::new(),
            pointers: vec!["/tenant".into(), "/order_id".into()],
        });
        let key = |payload: Value| derive_key(&env(json!({ "payload": payload })), b"", &s);
        let a = key(json!({"tenant": "acme", "order_id": 17, "at": 1})).expect("key");
        assert_eq!(a.text, r#"["acme","17"]"#);
        let again = key(json!({"order_id": 17, "tenant": "acme", "at": 2})).expect("key");
        assert_eq!((a.hash, &a.text), (again.hash, &again.text));
        let other = key(json!({"tenant": "umbrella", "order_id": 17})).expect("key");
        assert_ne!(a.hash, other.hash);
        let left = key(json!({"tenant": "a\",\"b", "order_id": "c"})).expect("key");
        let right = key(json!({"tenant": "a", "order_id": "b\",\"c"})).expect("key");
        assert_ne!(left.hash, right.hash);
        let err = key(json!({"tenant": "acme"})).unwrap_err().to_string();
        assert!(err.contains("/order_id"), "{err}");
    }

    #[test]
    fn header_key_reads_header() {
        let e = env(json!({"headers": {"msg-id": "m1"}}));
        let s = settings(KeySource::Header {
            name: "msg-id".into(),
        });
        assert_eq!(derive_key(&e, b"", &s).expect("key").text, "m1");
    }

    #[test]
    fn cloudevents_key_from_payload_or_headers_agree() {
        let structured = env(json!({"payload": {"source": "/shop", "id": "A1", "data": {}}}));
        let binary = env(json!({"headers": {"ce_source": "/shop", "ce_id": "A1"}}));
        let s = settings(KeySource::Cloudevents);
        let a = derive_key(&structured, b"", &s).expect("structured");
        let b = derive_key(&binary, b"", &s).expect("binary");
        assert_eq!(a, b);
        assert_ne!(
            cloudevents_key("a#b", "c").hash,
            cloudevents_key("a", "b#c").hash
        );
    }

    #[test]
    fn entity_from_payload_only_when_configured() {
        let e = env(json!({"id": "e1", "payload": {"order_id": "o-9"}}));
        let mut s = settings(KeySource::Id);
        assert_eq!(derive_entity(&e, &s).expect("default"), None);
        s.partition_key = PartitionSource::JsonPointer {
            pointer: "/order_id".into(),
        };
        assert_eq!(
            derive_entity(&e, &s).expect("pointer").as_deref(),
            Some("o-9")
        );
        s.partition_key = PartitionSource::EnvelopeKey;
        assert!(derive_entity(&e, &s).is_err());
    }

    #[test]
    fn entity_with_nul_is_refused() {
        let e = env(json!({"id": "e1", "key": "a\u{0}b"}));
        let mut s = settings(KeySource::Id);
        s.partition_key = PartitionSource::EnvelopeKey;
        assert!(derive_entity(&e, &s).is_err());
    }

    #[test]
    fn canonical_payload_ignores_key_order_and_whitespace() {
        let a: Value = serde_json::from_str(r#"{"b": 1, "a": [1, 2]}"#).expect("json");
        let b: Value = serde_json::from_str(r#"{"a":[1,2],"b":1}"#).expect("json");
        assert_eq!(
            fingerprint(&canonical_payload(&a)),
            fingerprint(&canonical_payload(&b))
        );
    }

    #[test]
    fn canonical_payload_keeps_every_digit_of_a_number() {
        let parse = |line: &str| {
            serde_json::from_str::<PipeLine>(line)
                .map(Envelope::from)
                .expect("envelope")
        };
        let a = parse(r#"{"id":"n","payload":{"n":12345678901234567890123}}"#);
        let b = parse(r#"{"id":"n","payload":{"n":12345678901234567890124}}"#);
        assert_eq!(
            canonical_payload(&a.payload),
            br#"{"n":12345678901234567890123}"#
        );
        assert_ne!(
            fingerprint(&canonical_payload(&a.payload)),
            fingerprint(&canonical_payload(&b.payload))
        );
        // Decimals too: neither is rounded to the nearest f64.
        let c = parse(r#"{"payload":{"x":0.10000000000000000000001}}"#);
        let d = parse(r#"{"payload":{"x":0.10000000000000000000002}}"#);
        assert_ne!(canonical_payload(&c.payload), canonical_payload(&d.payload));
    }

    #[test]
    fn canonical_payload_keeps_the_spelling_of_a_number() {
        // Documented choice: a number is compared by its text, not its value.
        let a: Value = serde_json::from_str(r#"{"p":1.0}"#).expect("json");
        let b: Value = serde_json::from_str(r#"{"p":1.00}"#).expect("json");
        assert_eq!(canonical_payload(&a), br#"{"p":1.0}"#);
        assert_eq!(canonical_payload(&b), br#"{"p":1.00}"#);
    }

    #[test]
    fn json_pointer_key_keeps_every_digit_of_a_number() {
        let s = settings(KeySource::JsonPointer {
            pointer: "/order".into(),
            pointers: vec![],
        });
        let a: Envelope =
            serde_json::from_str::<PipeLine>(r#"{"payload":{"order":12345678901234567890123}}"#)
                .map(Envelope::from)
                .expect("envelope");
        let b: Envelope =
            serde_json::from_str::<PipeLine>(r#"{"payload":{"order":12345678901234567890124}}"#)
                .map(Envelope::from)
                .expect("envelope");
        let ka = derive_key(&a, b"", &s).expect("key");
        assert_eq!(ka.text, "12345678901234567890123");
        assert_ne!(ka.hash, derive_key(&b, b"", &s).expect("key").hash);
    }

    #[test]
    fn content_hash_key_is_labelled_with_the_hash_it_is() {
        let e = env(json!({"payload": {"a": 1}}));
        let canonical = canonical_payload(&e.payload);
        let key = derive_key(&e, &canonical, &settings(KeySource::ContentHash)).expect("key");
        let h = xxh3_128(&canonical);
        // xxh3-128, not SHA: the label says so.
        assert_eq!(key.text, format!("xxh3:{h:032x}"));
        // The stored hash is unchanged, so claims keyed by earlier releases still match.
        assert_eq!(key.hash, h);
    }

    #[test]
    fn unknown_envelope_field_is_an_error() {
        assert!(serde_json::from_str::<PipeLine>(r#"{"id":"1","paylod":{}}"#).is_err());
    }
}

/// Fuzz targets (see `crate::fuzzing`): input lines as pipe mode decodes them, then every
/// key source, partition source and fingerprint setting over what decoded.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;
    use crate::config::FingerprintSpec;
    use crate::fuzzing;
    use crate::source::delivery::{key_delivery, Delivery, Keying, Payload, Target};
    use crate::source::pipe_line::PipeLine;

    /// Input lines as producers write them (JSON payloads, CloudEvents in the payload or
    /// in `ce_` headers, header keys), with an unknown field now and then.
    fn line() -> impl Strategy<Value = Vec<u8>> {
        let text = || prop::option::of(".{0,10}");
        let headers =
            prop::collection::btree_map("ce_id|ce_source|x-key|X-Key|.{0,4}", ".{0,10}", 0..4);
        (
            text(),
            text(),
            text(),
            headers,
            fuzzing::json(),
            any::<bool>(),
        )
            .prop_map(|(subscriber, id, key, headers, payload, unknown)| {
                let mut line = json!({ "headers": headers, "payload": payload });
                for (name, v) in [("subscriber", subscriber), ("id", id), ("key", key)] {
                    if let Some(v) = v {
                        line[name] = v.into();
                    }
                }
                if unknown {
                    line["extra"] = 1.into();
                }
                serde_json::to_vec(&line).unwrap_or_default()
            })
    }

    fn settings() -> impl Strategy<Value = SubscriberSettings> {
        let pointer = || "(/(id|source|order_id|a|b|0|1|-|~0|~1|.{0,3})){0,3}";
        let key = prop_oneof![
            Just(KeySource::Id),
            "ce_id|x-key|X-Key|.{0,3}".prop_map(|name| KeySource::Header { name }),
            pointer().prop_map(|pointer| KeySource::JsonPointer {
                pointer,
                pointers: Vec::new()
            }),
            prop::collection::vec(pointer(), 1..4).prop_map(|pointers| KeySource::JsonPointer {
                pointer: String::new(),
                pointers
            }),
            Just(KeySource::Cloudevents),
            Just(KeySource::ContentHash),
        ];
        let partition = prop_oneof![
            Just(PartitionSource::IdempotencyKey),
            Just(PartitionSource::EnvelopeKey),
            "x-key|.{0,3}".prop_map(|name| PartitionSource::Header { name }),
            pointer().prop_map(|pointer| PartitionSource::JsonPointer { pointer }),
        ];
        let ignore = prop::collection::vec(pointer(), 0..3);
        let max_key_bytes = prop_oneof![Just(1024usize), 1usize..16];
        (key, partition, ignore, max_key_bytes).prop_map(|(key, partition_key, ignore, max)| {
            SubscriberSettings {
                key,
                partition_key,
                max_key_bytes: max,
                fingerprint: FingerprintSpec { ignore },
                ..SubscriberSettings::default()
            }
        })
    }

    /// What keying a decoded line must satisfy under `s`.
    fn check_keys(env: &Envelope, s: &SubscriberSettings) -> Result<(), TestCaseError> {
        fuzzing::decoded();
        let canonical = canonical_payload(&env.payload);
        // Canonical bytes are a fixed point: decoding and re-encoding them changes nothing.
        let reparsed: Value =
            serde_json::from_slice(&canonical).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&canonical_payload(&reparsed), &canonical);
        let key = derive_key(env, &canonical, s);
        prop_assert_eq!(
            &key,
            &derive_key(env, &canonical, s),
            "keys are deterministic"
        );
        if let Ok(k) = &key {
            prop_assert!(!k.text.is_empty() && k.text.len() <= s.max_key_bytes);
            match &s.key {
                KeySource::Id | KeySource::Header { .. } => {
                    prop_assert_eq!(k.hash, key_hash(k.text.as_bytes()))
                }
                KeySource::ContentHash => prop_assert_eq!(k.hash, xxh3_128(&canonical)),
                _ => {}
            }
        }
        let entity = derive_entity(env, s);
        if let Ok(Some(t)) = &entity {
            prop_assert!(!t.is_empty() && !t.contains('\0') && t.len() <= s.max_key_bytes);
        }
        // Parsed or not, a payload gets one fingerprint.
        prop_assert_eq!(
            payload_fingerprint(&canonical, env.payload.clone(), &s.fingerprint),
            payload_fingerprint(&canonical, Value::Null, &s.fingerprint)
        );
        // The step every source shares agrees with the pieces.
        let delivery = Delivery {
            id: env.id.clone(),
            key: env.key.clone(),
            headers: env.headers.clone().into_iter().collect(),
            ..Delivery::new(Target::Name("s".into()), Payload::Json(env.payload.clone()))
        };
        match (key_delivery(delivery, s, Keying::Derive), key, entity) {
            (Ok(keys), Ok(k), Ok(e)) => {
                prop_assert_eq!(keys.key, k);
                prop_assert_eq!(keys.entity.as_deref(), e.as_deref());
            }
            (Err(_), Err(_), _) | (Err(_), Ok(_), Err(_)) => {}
            (shared, key, entity) => {
                return Err(TestCaseError::fail(format!(
                    "shared step {shared:?}, key {key:?}, entity {entity:?}"
                )))
            }
        }
        Ok(())
    }

    #[test]
    fn fuzz_input_lines_decode_and_key_or_are_refused() {
        let input = (fuzzing::hostile(300, line()), settings());
        fuzzing::run(
            "envelope_line",
            3000,
            input,
            |(bytes, s)| match serde_json::from_slice::<PipeLine>(&bytes).map(Envelope::from) {
                Ok(env) => check_keys(&env, &s),
                Err(_) => Ok(()),
            },
        );
    }

    /// A payload nested deeper than serde_json's limit (128) is a malformed line, not a
    /// stack overflow of the reader.
    #[test]
    fn deeply_nested_lines_are_refused_not_a_stack_overflow() {
        for depth in [200usize, 100_000] {
            for (open, close) in [("[", "]"), ("{\"a\":", "}")] {
                let line = format!(
                    "{{\"id\":\"e\",\"payload\":{}1{}}}",
                    open.repeat(depth),
                    close.repeat(depth)
                );
                let e = serde_json::from_str::<PipeLine>(&line)
                    .map(Envelope::from)
                    .expect_err("too deep");
                assert!(e.to_string().contains("recursion limit"), "{e}");
            }
        }
    }

    #[test]
    fn fuzz_well_formed_lines_key_consistently() {
        fuzzing::run("envelope_keys", 2000, (line(), settings()), |(bytes, s)| {
            match serde_json::from_slice::<PipeLine>(&bytes).map(Envelope::from) {
                Ok(env) => check_keys(&env, &s),
                // Only the unknown field is refused.
                Err(e) => {
                    prop_assert!(e.to_string().contains("unknown field"), "{}", e);
                    Ok(())
                }
            }
        });
    }
}
