//! The HTTP source: what a `POST /v1/subscribers/{s}/messages` request means as a
//! [`Delivery`], without the web framework.
//!
//! The body is the payload: JSON when it parses, and it must parse when the request's
//! content type promises JSON (or names none); under any other type a body that does not
//! parse is an opaque payload. The key is the `Idempotency-Key` header when given (checked
//! here: not empty, at most `max_key_bytes`), else whatever the subscriber's key source
//! names; the optional `Partition-Key` header is the partition key. Headers other than
//! credentials and transport headers become the message's headers, lowercased.
//!
//! The route that takes the request apart (`crate::admin`, the only user of axum) hands
//! `message` plain header pairs; [`super::delivery::route`] then keys and routes the
//! delivery as for every other source.

use std::collections::BTreeMap;

use serde_json::Value;

use super::delivery::{Delivery, Keying, Payload, Target};
use crate::config::{KeySource, SubscriberSettings};
use crate::envelope::IdempotencyKey;

/// The request header carrying the idempotency key (IETF draft `Idempotency-Key`).
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Optional request header with the partition key, for subscribers that route by it.
pub(crate) const PARTITION_KEY: &str = "partition-key";

/// Request headers that are not part of the message: credentials and transport headers
/// never reach a handler or a dead-letter record.
const NOT_MESSAGE_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "host",
    "connection",
    "keep-alive",
    "content-length",
    "transfer-encoding",
    "accept",
    "accept-encoding",
    "user-agent",
    IDEMPOTENCY_KEY,
];

/// A request as the HTTP source reads it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request<'a> {
    /// Header names (lowercase, as HTTP libraries hold them) in the order received, with
    /// the value as text, or `None` when it is not visible ASCII.
    pub(crate) headers: &'a [(&'a str, Option<&'a str>)],
    /// The media type of `Content-Type`, lowercased, without parameters; `None` when absent.
    pub(crate) media_type: Option<&'a str>,
    pub(crate) body: &'a [u8],
    /// When the request arrived, ms since the epoch.
    pub(crate) received_at_ms: u64,
}

/// Why a request is not a message. The caller answers 400 naming [`RequestError::field`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum RequestError {
    #[error("header `{0}` must be visible ASCII")]
    HeaderNotText(&'static str),
    #[error("the body is not valid JSON ({0}); send JSON, or a non-JSON payload under its own Content-Type (application/octet-stream, say)")]
    NotJson(serde_json::Error),
    #[error("the `Idempotency-Key` header is empty")]
    EmptyKey,
    #[error("the `Idempotency-Key` header is longer than {limit} bytes")]
    KeyTooLong { limit: usize },
    #[error("missing idempotency key: send an `Idempotency-Key` header")]
    MissingKey,
    #[error("the `Idempotency-Key` header starts with a quote but is not a structured-field string (RFC 8941: printable ASCII between two quotes, `\\\"` and `\\\\` escaped)")]
    BadQuotedKey,
}

impl RequestError {
    /// The request part at fault: a header name or `body`.
    pub(crate) fn field(&self) -> &'static str {
        match self {
            RequestError::HeaderNotText(name) => name,
            RequestError::NotJson(_) => "body",
            RequestError::EmptyKey
            | RequestError::KeyTooLong { .. }
            | RequestError::MissingKey
            | RequestError::BadQuotedKey => IDEMPOTENCY_KEY,
        }
    }
}

/// A request read as a message: the delivery, and the key its `Idempotency-Key` names.
#[derive(Debug)]
pub(crate) struct Message {
    pub(crate) delivery: Delivery,
    /// The checked `Idempotency-Key`; `None`: the subscriber's key source derives it.
    pub(crate) given: Option<IdempotencyKey>,
}

/// How [`super::delivery::route`] finds a message's key: the given one, else the
/// subscriber's key source.
pub(crate) fn keying(given: Option<&IdempotencyKey>) -> Keying<'_> {
    match given {
        Some(k) => Keying::Given(k),
        None => Keying::Derive,
    }
}

/// Reads `request` as a message for `subscriber`, which has `settings`. Checks, in this
/// order: the body against its content type, the `Idempotency-Key` and `Partition-Key`
/// headers as text, then the given key (or, without one, that the subscriber's key source
/// can find a key in this body).
pub(crate) fn message(
    request: &Request<'_>,
    subscriber: Target,
    settings: &SubscriberSettings,
) -> Result<Message, RequestError> {
    let json_body = payload_json(request.media_type, request.body)?;
    let given = header(request, IDEMPOTENCY_KEY)?;
    let key = header(request, PARTITION_KEY)?.map(str::to_string);
    let id = json_body
        .as_ref()
        .and_then(|v| v.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let is_json = json_body.is_some();
    let payload = match json_body {
        Some(v) => Payload::Json(v),
        None => Payload::Opaque(request.body.to_vec()),
    };
    let given = match given {
        Some(k) => Some(given_key(k, settings.max_key_bytes)?),
        None => {
            let derivable = is_json
                || matches!(
                    settings.key,
                    KeySource::ContentHash | KeySource::Header { .. }
                );
            if !derivable {
                return Err(RequestError::MissingKey);
            }
            None
        }
    };
    let delivery = Delivery {
        id,
        key,
        headers: message_headers(request.headers),
        lowercase_header_names: true,
        origin: Some("http".into()),
        received_at_ms: request.received_at_ms,
        ..Delivery::new(subscriber, payload)
    };
    Ok(Message { delivery, given })
}

/// The first value of header `name`, if any; one that is not visible ASCII is an error.
fn header<'a>(request: &Request<'a>, name: &'static str) -> Result<Option<&'a str>, RequestError> {
    match request.headers.iter().find(|(k, _)| *k == name) {
        None => Ok(None),
        Some((_, Some(v))) => Ok(Some(v)),
        Some((_, None)) => Err(RequestError::HeaderNotText(name)),
    }
}

/// An `Idempotency-Key` value: an RFC 8941 string (`"k-1"`, as the IETF draft defines
/// the header) is its content, unquoted; any other value is taken as written (a bare
/// token, as clients send it in practice), trimmed. Not empty, at most `max_bytes`.
fn given_key(value: &str, max_bytes: usize) -> Result<IdempotencyKey, RequestError> {
    let k = value.trim();
    let unquoted;
    let k = match k.strip_prefix('"') {
        Some(quoted) => {
            unquoted = sf_string(quoted).ok_or(RequestError::BadQuotedKey)?;
            unquoted.as_str()
        }
        None => k,
    };
    if k.is_empty() {
        return Err(RequestError::EmptyKey);
    }
    if k.len() > max_bytes {
        return Err(RequestError::KeyTooLong { limit: max_bytes });
    }
    Ok(IdempotencyKey::from_id(k))
}

/// The content of an RFC 8941 sf-string whose opening quote is already taken: printable
/// ASCII up to the closing quote, which ends the value; `\"` and `\\` are the only escapes.
fn sf_string(rest: &str) -> Option<String> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return chars.as_str().is_empty().then_some(out),
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return None,
            },
            ' '..='~' => out.push(c),
            _ => return None,
        }
    }
    None
}

/// Whether a media type promises JSON: absent, `application/json` or `application/*+json`.
pub(crate) fn promises_json(media_type: Option<&str>) -> bool {
    match media_type {
        None => true,
        Some(t) => {
            t == "application/json" || (t.starts_with("application/") && t.ends_with("+json"))
        }
    }
}

/// The body as JSON when it is JSON. A body whose content type promises JSON (or that
/// names none) must parse, so a client's broken JSON is refused instead of being stored as
/// opaque bytes; under any other type a body that does not parse is an opaque payload.
fn payload_json(media_type: Option<&str>, body: &[u8]) -> Result<Option<Value>, RequestError> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(Some(v)),
        Err(e) if promises_json(media_type) => Err(RequestError::NotJson(e)),
        Err(_) => Ok(None),
    }
}

/// The message's headers: every text header but credentials and transport headers, by
/// name (lowercase); of repeated names the last value.
fn message_headers(headers: &[(&str, Option<&str>)]) -> Vec<(String, String)> {
    let mut kept = BTreeMap::new();
    for (k, v) in headers {
        if NOT_MESSAGE_HEADERS.contains(k) {
            continue;
        }
        if let Some(v) = v {
            kept.insert(k.to_string(), v.to_string());
        }
    }
    kept.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_promised_by_json_types_and_by_no_type() {
        assert!(promises_json(None));
        assert!(promises_json(Some("application/json")));
        assert!(promises_json(Some("application/cloudevents+json")));
        assert!(!promises_json(Some("application/octet-stream")));
        assert!(!promises_json(Some("text/json")));
    }

    #[test]
    fn broken_json_is_refused_only_when_json_is_promised() {
        assert!(matches!(
            payload_json(None, b"{not json"),
            Err(RequestError::NotJson(_))
        ));
        assert!(matches!(
            payload_json(Some("application/octet-stream"), b"{not json"),
            Ok(None)
        ));
    }

    #[test]
    fn credentials_and_transport_headers_are_not_message_headers() {
        let headers = [
            ("authorization", Some("Bearer secret")),
            ("idempotency-key", Some("k1")),
            ("x-trace", Some("a")),
            ("x-trace", Some("b")),
            ("x-binary", None),
            ("content-type", Some("application/json")),
        ];
        assert_eq!(
            message_headers(&headers),
            vec![
                ("content-type".to_string(), "application/json".to_string()),
                ("x-trace".to_string(), "b".to_string()),
            ]
        );
    }

    #[test]
    fn given_key_is_trimmed_and_bounded() {
        assert_eq!(given_key("  k1 ", 8).unwrap().text, "k1");
        assert!(matches!(given_key("   ", 8), Err(RequestError::EmptyKey)));
        assert!(matches!(
            given_key("123456789", 8),
            Err(RequestError::KeyTooLong { limit: 8 })
        ));
    }

    /// RFC 8941 strings (the IETF draft's form) are their content: `"k-1"` and `k-1` are
    /// one key. Escapes are unescaped; a malformed quoted value is refused.
    #[test]
    fn quoted_keys_are_structured_field_strings() {
        assert_eq!(
            given_key("\"k-1\"", 64).unwrap(),
            given_key("k-1", 64).unwrap()
        );
        assert_eq!(given_key(" \"k 1\" ", 64).unwrap().text, "k 1");
        assert_eq!(given_key(r#""a\"b\\c""#, 64).unwrap().text, r#"a"b\c"#);
        for bad in [r#""open"#, r#""a"b""#, r#""a\x""#, "\"tab\there\""] {
            assert!(
                matches!(given_key(bad, 64), Err(RequestError::BadQuotedKey)),
                "{bad}"
            );
        }
        assert!(matches!(given_key("\"\"", 64), Err(RequestError::EmptyKey)));
        // Bare tokens are taken as written, as before.
        assert_eq!(given_key("k-\"1", 64).unwrap().text, "k-\"1");
    }
}
