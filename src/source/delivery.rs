//! The step every source shares: a [`Delivery`] (what a source received, in one shape)
//! becomes a routed [`Job`] in [`route`]: payload decoded, idempotency key derived,
//! payload fingerprinted, entity derived, shard chosen by [`Ledger::place`]. Pipe mode,
//! HTTP ingest, the Kafka source and the replay of stored records all go through it, so
//! they key, fingerprint and route a message the same way.
//!
//! What stays with each source: reading its input, its own key overrides (HTTP's
//! `Idempotency-Key` header, Kafka's hashing of binary header ids, a replayed record's
//! stored key, see [`Keying`]) and how it answers a refusal (a pipe `rejected` line, an
//! HTTP 400, a Kafka dead letter): [`RouteError`] says which step refused, so each
//! source keeps its own texts and statuses.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use crate::config::{KeySource, PartitionSource, SubscriberSettings};
use crate::envelope::{
    canonical_payload, derive_entity, derive_key, payload_fingerprint, payload_json, Envelope,
    IdempotencyKey, KeyError,
};
use crate::ledger::{AckSender, Job, Ledger, LedgerError, Origin, Subscriber};

/// Which subscriber a delivery is for.
#[derive(Debug, Clone)]
pub enum Target {
    /// A name still to be looked up (pipe lines name theirs).
    Name(String),
    /// A subscriber the source already resolved (HTTP path, Kafka binding, a record).
    Resolved(Arc<Subscriber>),
}

/// A message's body as the source has it.
///
/// This is the one place that decides which bytes a message is fingerprinted over and
/// handed to handlers as (`payload` of `wit/handler.wit`); they are always the same bytes,
/// which quarantine and dead-letter records keep and a replay hands back:
///
/// - JSON a source parsed (a pipe line's `payload`, an HTTP JSON body): its canonical
///   bytes (compact, object keys sorted, numbers as written), so a re-encoding of the same
///   event is a duplicate.
/// - Anything else (a Kafka record value, an HTTP body sent under another type, a replayed
///   record): the bytes as received. A Kafka record value that is JSON is NOT canonicalised:
///   a redelivery is byte-identical, and claims stored by earlier releases carry the
///   fingerprint of the raw bytes, which must keep matching. A handler that wants
///   structure parses the bytes itself.
#[derive(Debug, Clone)]
pub enum Payload {
    /// Parsed JSON; handlers and the fingerprint get its canonical bytes.
    Json(Value),
    /// Bytes that are not JSON by the source's account (an HTTP body of another type): key
    /// sources that read JSON find nothing in them.
    Opaque(Vec<u8>),
    /// Bytes that may be JSON (a Kafka record value, a replayed record): parsed only when a
    /// key source or partition key reads JSON; not JSON then means nothing is there.
    Bytes(Vec<u8>),
}

/// One message as any source received it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub subscriber: Target,
    /// The producer's message id (an `id` field), if the source has one.
    pub id: Option<String>,
    /// Partition key (envelope `key`, Kafka record key, HTTP `Partition-Key`).
    pub key: Option<String>,
    /// Headers in the order received; a key source reading a header takes the last value.
    pub headers: Vec<(String, String)>,
    /// Header names are case-insensitive and held lowercased (HTTP): a `header` key source
    /// is matched lowercased.
    pub(crate) lowercase_header_names: bool,
    pub payload: Payload,
    /// Where the message came from (e.g. `kafka:orders/3/1234`), kept in records.
    pub(crate) origin: Option<Origin>,
    /// When the source received it, ms since the epoch (0: when the shard first decides).
    pub(crate) received_at_ms: u64,
}

impl Delivery {
    /// A delivery with no id, partition key, headers, origin or receive time.
    pub fn new(subscriber: Target, payload: Payload) -> Delivery {
        Delivery {
            subscriber,
            id: None,
            key: None,
            headers: Vec::new(),
            lowercase_header_names: false,
            payload,
            origin: None,
            received_at_ms: 0,
        }
    }
}

/// A hook that may replace the derived key's hash (see [`Keying::DeriveThen`]).
pub(crate) type HashOverride<'a> = &'a dyn Fn(&Envelope, &SubscriberSettings) -> Option<u128>;

/// How the idempotency key is found.
#[derive(Clone, Copy)]
pub enum Keying<'a> {
    /// From the subscriber's key source (`derive_key`).
    Derive,
    /// The source names it: an HTTP `Idempotency-Key` header (checked by the source), the
    /// stored key of a replayed record.
    Given(&'a IdempotencyKey),
    /// Derived, then the source may replace the hash (Kafka hashes ids read from headers
    /// over their raw bytes, `source/kafka/keying.rs`).
    DeriveThen(HashOverride<'a>),
}

impl std::fmt::Debug for Keying<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keying::Derive => f.write_str("Derive"),
            Keying::Given(k) => f.debug_tuple("Given").field(k).finish(),
            Keying::DeriveThen(_) => f.write_str("DeriveThen(..)"),
        }
    }
}

/// Which step refused a delivery. Displays as the underlying error, unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The subscriber is unknown (only for [`Target::Name`]).
    #[error("{0}")]
    Subscriber(LedgerError),
    /// No usable idempotency key.
    #[error("{error}")]
    Key {
        subscriber: Arc<str>,
        error: KeyError,
    },
    /// The key was found, the partition key was not usable.
    #[error("{error}")]
    Entity {
        subscriber: Arc<str>,
        key: IdempotencyKey,
        error: KeyError,
    },
}

/// A routed job: the subscriber it is for, the job and the shard that decides it. The
/// source numbers the job (`job.seq`) before submitting it.
#[derive(Debug)]
pub struct Routed {
    pub(crate) sub: Arc<Subscriber>,
    pub job: Job,
    pub shard: usize,
}

/// A delivery's idempotency key and entity (see [`derive_entity`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    pub(crate) key: IdempotencyKey,
    pub(crate) entity: Option<String>,
}

/// The bytes fingerprinted and handed to handlers, and the JSON key sources read (see
/// [`Payload`]).
fn decode(payload: Payload, settings: &SubscriberSettings) -> (Vec<u8>, Value) {
    match payload {
        Payload::Json(v) => (canonical_payload(&v), v),
        Payload::Opaque(bytes) => (bytes, Value::Null),
        Payload::Bytes(bytes) => {
            let json = payload_json(&bytes, settings);
            (bytes, json)
        }
    }
}

/// The idempotency key and entity of a decoded message. The entity is checked either way
/// (a message with a bad partition key is refused whether or not it is used), and
/// returned only when `want_entity`: only a handler's placement uses it.
fn keys(
    subscriber: &Arc<str>,
    env: &Envelope,
    bytes: &[u8],
    settings: &SubscriberSettings,
    keying: Keying<'_>,
    want_entity: bool,
) -> Result<Keys, RouteError> {
    let key = match keying {
        Keying::Given(k) => k.clone(),
        Keying::Derive | Keying::DeriveThen(_) => {
            // `open` put the headers read under the names the settings give them.
            let mut key = derive_key(env, bytes, settings).map_err(|error| RouteError::Key {
                subscriber: subscriber.clone(),
                error,
            })?;
            if let Keying::DeriveThen(adjust) = keying {
                if let Some(hash) = adjust(env, settings) {
                    key.hash = hash;
                }
            }
            key
        }
    };
    match derive_entity(env, settings) {
        Ok(entity) => Ok(Keys {
            key,
            entity: entity.filter(|_| want_entity).map(Cow::into_owned),
        }),
        Err(error) => Err(RouteError::Entity {
            subscriber: subscriber.clone(),
            key,
            error,
        }),
    }
}

/// Takes from a delivery the envelope key sources read and the bytes handlers get; what
/// is left (headers, origin, receive time) goes on the job.
fn open(delivery: &mut Delivery, settings: &SubscriberSettings) -> (Envelope, Vec<u8>) {
    let (bytes, json) = decode(
        std::mem::replace(&mut delivery.payload, Payload::Opaque(Vec::new())),
        settings,
    );
    let lower = delivery.lowercase_header_names;
    let env = Envelope {
        id: delivery.id.take(),
        key: delivery.key.take(),
        headers: headers_read(&delivery.headers, settings, lower),
        payload: json,
    };
    (env, bytes)
}

/// The headers the subscriber's key source and partition source read ([`derive_key`],
/// [`derive_entity`]), under the names the settings give them; later headers with the
/// same name win. A source whose header names arrive lowercased (HTTP) matches a
/// configured name in any case (`X-Tenant` reads `x-tenant`). Only these are copied: the
/// job keeps every header (`delivery.headers`), and copying them all again per message
/// cost the Kafka consumer thread ~80 ns per header.
fn headers_read(
    headers: &[(String, String)],
    settings: &SubscriberSettings,
    lowercase_header_names: bool,
) -> BTreeMap<String, String> {
    let by_key: &[&str] = match &settings.key {
        KeySource::Header { name } => &[name.as_str()],
        KeySource::Cloudevents => &["ce_source", "ce_id"],
        _ => &[],
    };
    let by_partition: &[&str] = match &settings.partition_key {
        PartitionSource::Header { name } => &[name.as_str()],
        _ => &[],
    };
    let mut read = BTreeMap::new();
    for (name, value) in headers {
        for &wanted in by_key.iter().chain(by_partition) {
            let same = if lowercase_header_names {
                wanted.eq_ignore_ascii_case(name)
            } else {
                wanted == name
            };
            if same {
                read.insert(wanted.to_string(), value.clone());
            }
        }
    }
    read
}

/// The key and entity a delivery would get under `settings`, without routing it.
pub(crate) fn key_delivery(
    delivery: Delivery,
    settings: &SubscriberSettings,
    keying: Keying<'_>,
) -> Result<Keys, RouteError> {
    let mut delivery = delivery;
    let subscriber: Arc<str> = match &delivery.subscriber {
        Target::Name(n) => n.as_str().into(),
        Target::Resolved(s) => s.name.clone(),
    };
    let (env, bytes) = open(&mut delivery, settings);
    keys(&subscriber, &env, &bytes, settings, keying, true)
}

/// Turns a delivery into a routed job: resolves the subscriber, decodes the payload,
/// derives the key and fingerprint, derives the entity and places the job on its shard.
/// Every source and the replay of records come through here.
pub fn route(
    ledger: &Ledger,
    delivery: Delivery,
    keying: Keying<'_>,
    ack: AckSender,
) -> Result<Routed, RouteError> {
    route_or_return(ledger, delivery, keying, ack).map_err(|refused| refused.0)
}

/// What a refused delivery gives back to its source for a dead-letter record: its id,
/// partition key, headers and origin as the source set them, and the payload as the bytes
/// it would have been fingerprinted over (see [`Payload`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Unrouted {
    pub(crate) id: Option<String>,
    pub(crate) key: Option<String>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) origin: Option<Origin>,
    pub(crate) payload: Vec<u8>,
}

impl Unrouted {
    /// The parts of a delivery not opened yet.
    fn of(delivery: Delivery) -> Unrouted {
        let payload = match delivery.payload {
            Payload::Json(v) => canonical_payload(&v),
            Payload::Opaque(bytes) | Payload::Bytes(bytes) => bytes,
        };
        Unrouted {
            id: delivery.id,
            key: delivery.key,
            headers: delivery.headers,
            origin: delivery.origin,
            payload,
        }
    }
}

/// [`route`], giving a refused delivery's parts back with the refusal: a source that
/// keeps a dead-letter record of refused input need not copy every message's id, key and
/// headers beforehand for the rare one refused (boxed: the refusal is the rare path).
pub(crate) fn route_or_return(
    ledger: &Ledger,
    delivery: Delivery,
    keying: Keying<'_>,
    ack: AckSender,
) -> Result<Routed, Box<(RouteError, Unrouted)>> {
    let sub = match &delivery.subscriber {
        Target::Resolved(s) => s.clone(),
        Target::Name(name) => match ledger.subscriber(name) {
            Ok(sub) => sub,
            Err(e) => {
                return Err(Box::new((
                    RouteError::Subscriber(e),
                    Unrouted::of(delivery),
                )))
            }
        },
    };
    // A change from another source would belong to no partition (`ledger/changelog.rs`).
    if sub.has_changelog()
        && delivery
            .origin
            .as_ref()
            .and_then(Origin::kafka_partition)
            .is_none()
    {
        let e = RouteError::Subscriber(LedgerError::Invalid(format!(
            "subscriber {:?} takes its messages from Kafka with a changelog (changelog = true): a message from another source would change claims and state that no partition owns; produce it to the subscription's topic",
            sub.name
        )));
        return Err(Box::new((e, Unrouted::of(delivery))));
    }
    let settings = sub.settings();
    let mut delivery = delivery;
    let (mut env, bytes) = open(&mut delivery, &settings);
    // Read once: the entity is copied only for a placement that uses it, and the job is
    // placed by this same reading.
    let has_handler = sub.has_handler();
    let Keys { key, entity } = match keys(&sub.name, &env, &bytes, &settings, keying, has_handler) {
        Ok(keys) => keys,
        Err(e) => {
            // `open` took the id and the partition key into the envelope; nothing else
            // changed them.
            let back = Unrouted {
                id: env.id,
                key: env.key,
                headers: delivery.headers,
                origin: delivery.origin,
                payload: bytes,
            };
            return Err(Box::new((e, back)));
        }
    };
    // Keyed: the parsed payload is needed only for the fingerprint now.
    let payload = std::mem::take(&mut env.payload);
    let mut job = Job::new(
        0,
        sub.id,
        key.hash,
        payload_fingerprint(&bytes, payload, &settings.fingerprint),
        "",
        &[],
        ack,
    );
    // The key's text and the payload move into the job: no second copy of either.
    job.id = key.text.into_boxed_str();
    job.payload = bytes.into_boxed_slice();
    job.headers = delivery.headers;
    job.partition_key = env.key;
    job.origin = delivery.origin;
    job.received_at_ms = delivery.received_at_ms;
    let shard = ledger.place_as(&sub, has_handler, &mut job, entity);
    Ok(Routed { sub, job, shard })
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use super::*;
    use crate::clock::SystemClock;
    use crate::config::{Config, PartitionSource};
    use crate::envelope::key_hash;
    use serde_json::json;

    fn ledger(dir: &std::path::Path) -> Ledger {
        let mut config = Config::default();
        config.ledger.shards = std::num::NonZeroUsize::new(2);
        Ledger::open(dir, &config, Arc::new(SystemClock)).unwrap()
    }

    fn route(ledger: &Ledger, d: Delivery, keying: Keying<'_>) -> Result<Routed, RouteError> {
        super::route(ledger, d, keying, crossbeam_channel::unbounded().0)
    }

    #[test]
    fn parsed_json_is_fingerprinted_and_handed_on_canonical() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = ledger(dir.path());
        let payload: Value = serde_json::from_str(r#"{ "b": 1, "a": 1.50 }"#).unwrap();
        let d = Delivery {
            id: Some("e-1".into()),
            ..Delivery::new(Target::Name("default".into()), Payload::Json(payload))
        };
        let r = route(&ledger, d, Keying::Derive).unwrap();
        assert_eq!(&*r.job.payload, br#"{"a":1.50,"b":1}"#);
        assert_eq!(
            r.job.fingerprint,
            crate::envelope::fingerprint(br#"{"a":1.50,"b":1}"#)
        );
        assert_eq!((&*r.job.id, r.job.key), ("e-1", key_hash(b"e-1")));
    }

    /// A sink that is never reached: these tests only route.
    #[derive(Debug)]
    struct Unused;

    impl crate::ledger::changelog::ChangelogSink for Unused {
        fn publish(
            &self,
            _: &[crate::ledger::changelog::Change],
        ) -> Result<Box<dyn crate::ledger::changelog::Published>, crate::ledger::changelog::SinkError>
        {
            Err("not reached".into())
        }
    }

    #[test]
    fn a_subscriber_with_a_changelog_takes_only_kafka_messages() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = ledger(dir.path());
        ledger
            .set_changelog("default", Some(Arc::new(Unused)))
            .unwrap();
        let delivery = |origin: Option<Origin>| Delivery {
            id: Some("e-1".into()),
            origin,
            ..Delivery::new(
                Target::Name("default".into()),
                Payload::Json(serde_json::json!({"a": 1})),
            )
        };
        for refused in [None, Some(Origin::from("http"))] {
            let e = route(&ledger, delivery(refused), Keying::Derive).unwrap_err();
            assert!(e.to_string().contains("changelog = true"), "{e}");
        }
        let live = Origin::Kafka {
            topic: "t".into(),
            partition: 1,
            offset: 9,
        };
        // A Kafka message, and a stored one replayed (its origin read back as text).
        for taken in [live, Origin::from("kafka:t/1/9")] {
            assert!(route(&ledger, delivery(Some(taken)), Keying::Derive).is_ok());
        }
    }

    #[test]
    fn header_sources_match_lowercased_header_names_in_any_case() {
        // HTTP hands header names on lowercased; a config names them as people write them.
        let dir = tempfile::tempdir().unwrap();
        let ledger = ledger(dir.path());
        let mut settings = (*ledger.subscriber("default").unwrap().settings()).clone();
        settings.key = KeySource::Header {
            name: "Message-Id".into(),
        };
        settings.partition_key = PartitionSource::Header {
            name: "X-Tenant".into(),
        };
        let delivery = |lowercase_header_names: bool| Delivery {
            headers: vec![
                ("traceparent".into(), "00-4bf9-00f0-01".into()),
                ("message-id".into(), "m-1".into()),
                ("x-tenant".into(), "t-0".into()),
                ("x-tenant".into(), "t-1".into()),
            ],
            lowercase_header_names,
            ..Delivery::new(
                Target::Name("default".into()),
                Payload::Bytes(b"{}".to_vec()),
            )
        };
        let keys = key_delivery(delivery(true), &settings, Keying::Derive).unwrap();
        assert_eq!(keys.key, IdempotencyKey::from_id("m-1"));
        // The last header of a name wins, for the partition key as for the key.
        assert_eq!(keys.entity.as_deref(), Some("t-1"));
        // A source that keeps names as sent (Kafka) matches them exactly.
        let e = key_delivery(delivery(false), &settings, Keying::Derive).unwrap_err();
        assert!(e.to_string().contains("Message-Id"), "{e}");
    }

    #[test]
    fn record_bytes_are_fingerprinted_and_handed_on_as_sent() {
        // A Kafka record value that is JSON, but not canonical: handlers get it as sent.
        let dir = tempfile::tempdir().unwrap();
        let ledger = ledger(dir.path());
        let sub = ledger.subscriber("default").unwrap();
        let raw = br#"{ "b": 1, "a": 1.50 }"#.to_vec();
        let given = IdempotencyKey::from_id("m-1");
        let d = Delivery {
            key: Some("o-1".into()),
            headers: vec![("h".into(), "1".into()), ("h".into(), "2".into())],
            origin: Some("kafka:t/0/7".into()),
            received_at_ms: 42,
            ..Delivery::new(Target::Resolved(sub), Payload::Bytes(raw.clone()))
        };
        let r = route(&ledger, d, Keying::Given(&given)).unwrap();
        assert_eq!(&*r.job.payload, &raw[..]);
        assert_eq!(r.job.fingerprint, crate::envelope::fingerprint(&raw));
        assert_eq!((&*r.job.id, r.job.key), ("m-1", given.hash));
        // Headers reach the job as received, repeats and order kept.
        assert_eq!(
            r.job.headers,
            vec![("h".to_string(), "1".to_string()), ("h".into(), "2".into())]
        );
        assert_eq!(r.job.partition_key.as_deref(), Some("o-1"));
        assert_eq!(
            r.job.origin.as_ref().map(ToString::to_string).as_deref(),
            Some("kafka:t/0/7")
        );
        assert_eq!(r.job.received_at_ms, 42);
    }

    #[test]
    fn record_bytes_are_read_as_json_by_a_pointer_key_source() {
        let mut s = SubscriberSettings {
            key: KeySource::JsonPointer {
                pointer: "/order/id".into(),
                pointers: vec![],
            },
            ..SubscriberSettings::default()
        };
        let d = || {
            Delivery::new(
                Target::Name("default".into()),
                Payload::Bytes(br#"{"order":{"id":"A-7"}}"#.to_vec()),
            )
        };
        let keys = key_delivery(d(), &s, Keying::Derive).unwrap();
        assert_eq!(keys.key.text, "A-7");
        // Declared not JSON (an HTTP body of another type): nothing at any pointer.
        let opaque = Delivery::new(
            Target::Name("default".into()),
            Payload::Opaque(br#"{"order":{"id":"A-7"}}"#.to_vec()),
        );
        assert!(matches!(
            key_delivery(opaque, &s, Keying::Derive),
            Err(RouteError::Key { .. })
        ));
        s.key = KeySource::Id;
        s.partition_key = PartitionSource::EnvelopeKey;
        let given = IdempotencyKey::from_id("m-1");
        match key_delivery(d(), &s, Keying::Given(&given)) {
            Err(RouteError::Entity { key, error, .. }) => {
                assert_eq!(key, given);
                assert!(error.to_string().contains("no partition key"), "{error}");
            }
            other => panic!("expected an entity error, got {other:?}"),
        }
    }

    #[test]
    fn header_key_source_matches_lowercased_names_when_asked() {
        let s = SubscriberSettings {
            key: KeySource::Header {
                name: "Message-Id".into(),
            },
            ..SubscriberSettings::default()
        };
        let d = |lower| Delivery {
            headers: vec![("message-id".into(), "m-9".into())],
            lowercase_header_names: lower,
            ..Delivery::new(Target::Name("s".into()), Payload::Opaque(Vec::new()))
        };
        assert_eq!(
            key_delivery(d(true), &s, Keying::Derive).unwrap().key.text,
            "m-9"
        );
        assert!(key_delivery(d(false), &s, Keying::Derive).is_err());
    }

    #[test]
    fn a_refused_delivery_comes_back_as_the_source_gave_it() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = ledger(dir.path());
        let sub = ledger.subscriber("default").unwrap();
        // The default subscriber keys by `id`: none here, so the key step refuses it.
        let d = Delivery {
            key: Some("orders.7".into()),
            headers: vec![("b".into(), "2".into()), ("a".into(), "1".into())],
            origin: Some("nats:ORDERS/9".into()),
            received_at_ms: 42,
            ..Delivery::new(Target::Resolved(sub), Payload::Bytes(b"not json".to_vec()))
        };
        let (e, back) = *route_or_return(
            &ledger,
            d.clone(),
            Keying::Derive,
            crossbeam_channel::unbounded().0,
        )
        .unwrap_err();
        assert!(matches!(e, RouteError::Key { .. }), "{e:?}");
        assert_eq!(
            back,
            Unrouted {
                id: None,
                key: d.key.clone(),
                headers: d.headers.clone(),
                origin: d.origin.clone(),
                payload: b"not json".to_vec(),
            }
        );
        // Refused before it is opened (an unknown subscriber): the same parts, a parsed
        // payload as its canonical bytes.
        let d = Delivery {
            id: Some("e-1".into()),
            ..Delivery::new(
                Target::Name("not a name".into()),
                Payload::Json(json!({"b": 1, "a": 2})),
            )
        };
        let (e, back) =
            *route_or_return(&ledger, d, Keying::Derive, crossbeam_channel::unbounded().0)
                .unwrap_err();
        assert!(matches!(e, RouteError::Subscriber(_)), "{e:?}");
        assert_eq!(back.id.as_deref(), Some("e-1"));
        assert_eq!(back.payload, br#"{"a":2,"b":1}"#);
    }

    #[test]
    fn unknown_subscriber_is_refused_before_keying() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = ledger(dir.path());
        let d = Delivery::new(Target::Name("not a name".into()), Payload::Json(json!({})));
        assert!(matches!(
            route(&ledger, d, Keying::Derive),
            Err(RouteError::Subscriber(_))
        ));
    }
}
