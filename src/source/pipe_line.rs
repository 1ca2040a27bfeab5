//! The pipe's wire type: one line of `dedupd pipe` input, which `dedupd handler test`
//! reads too.
//!
//! `{"subscriber": S, "id": I, "key": K, "headers": {...}, "payload": P}`, every field
//! optional and no other field allowed (a misspelt `"ID"` is refused, not silently read as
//! a message without an id). A line becomes a [`Delivery`] whose payload is the JSON
//! value; what keys it is then [`crate::source::delivery::route`]'s concern.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::delivery::{Delivery, Payload, Target};

/// One input line as sent.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PipeLine {
    /// Subscriber the message is for; pipe mode falls back to the configured default.
    pub(crate) subscriber: Option<String>,
    /// The producer's message id.
    pub(crate) id: Option<String>,
    /// Partition key (routing and ordering), not an idempotency key.
    pub(crate) key: Option<String>,
    /// String headers (`ce_id`, `ce_source`, or any header a key source names).
    #[serde(default)]
    pub(crate) headers: BTreeMap<String, String>,
    /// The message body.
    #[serde(default)]
    pub(crate) payload: Value,
}

impl PipeLine {
    /// The line as a delivery for `target` (its `subscriber` field already resolved by the
    /// caller into `target`).
    pub(crate) fn into_delivery(self, target: Target) -> Delivery {
        Delivery {
            id: self.id,
            key: self.key,
            headers: self.headers.into_iter().collect(),
            ..Delivery::new(target, Payload::Json(self.payload))
        }
    }
}

/// The line as key sources read it (tests build envelopes from JSON this way).
#[cfg(test)]
impl From<PipeLine> for crate::envelope::Envelope {
    fn from(l: PipeLine) -> Self {
        crate::envelope::Envelope {
            id: l.id,
            key: l.key,
            headers: l.headers,
            payload: l.payload,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_with_an_unknown_field_is_refused() {
        let err = serde_json::from_str::<PipeLine>(r#"{"ID": "a", "payload": 1}"#)
            .expect_err("unknown field");
        assert!(err.to_string().contains("unknown field `ID`"), "{err}");
    }

    #[test]
    fn a_line_becomes_a_delivery_with_its_parts() {
        let line: PipeLine = serde_json::from_str(
            r#"{"id": "o-1", "key": "k", "headers": {"ce_id": "1"}, "payload": {"n": 2}}"#,
        )
        .expect("a line");
        let d = line.into_delivery(Target::Name("billing".into()));
        assert_eq!(d.id.as_deref(), Some("o-1"));
        assert_eq!(d.key.as_deref(), Some("k"));
        assert_eq!(d.headers, vec![("ce_id".to_string(), "1".to_string())]);
        assert!(matches!(d.payload, Payload::Json(ref v) if v["n"] == 2));
    }
}
