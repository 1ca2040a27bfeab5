//! Where a subscriber's idempotency key and the entity of its state come from: the
//! sources, and how a source as written is checked before it becomes one.

use serde::{Deserialize, Serialize};

/// Where a subscriber's idempotency key comes from.
///
/// Read through [`SourceSpec`]: serde's internally tagged enums drop unknown fields of
/// unit variants (`{ source = "id", pointer = "/x" }` loaded as `id`), and a typo in a key
/// source changes what is deduplicated, so every field a source does not take is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(
    tag = "source",
    rename_all = "snake_case",
    deny_unknown_fields,
    try_from = "SourceSpec"
)]
pub enum KeySource {
    /// The envelope's `id` field.
    Id,
    /// A header value.
    Header { name: String },
    /// A JSON pointer (RFC 6901) into the payload, e.g. `/order/id`; or, as `pointers`,
    /// several whose values together are the key (a composite key such as
    /// `["/tenant", "/order_id"]`). Exactly one of the two is given.
    JsonPointer {
        #[serde(default, skip_serializing_if = "String::is_empty")]
        pointer: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pointers: Vec<String>,
    },
    /// CloudEvents: `source` + `id`, from the payload (structured mode) or the
    /// `ce_source`/`ce_id` headers (binary mode).
    Cloudevents,
    /// A hash of the canonical payload. Opt-in only: two different events with equal
    /// payloads become duplicates.
    ContentHash,
}

/// The entity of a handler subscriber's state (see "Placements" in `docs/design.md`):
/// messages that share a partition key run on the same shard and see one store of their
/// own. Without a handler it is not used; the idempotency key (the default) means "no
/// entity": the handler's state is one store and it runs on one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(
    tag = "source",
    rename_all = "snake_case",
    deny_unknown_fields,
    try_from = "SourceSpec"
)]
pub enum PartitionSource {
    /// No entity: a handler's state is one store (and the handler runs on one shard).
    #[default]
    IdempotencyKey,
    /// The envelope's `key` field (a Kafka record key, say).
    EnvelopeKey,
    /// A header value.
    Header { name: String },
    /// A JSON pointer into the payload, e.g. `/order_id`.
    JsonPointer { pointer: String },
}

/// A key or partition key source as written: every field any source takes, checked
/// against the ones the named source takes when it becomes a [`KeySource`] or
/// [`PartitionSource`].
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SourceSpec {
    source: String,
    name: Option<String>,
    pointer: Option<String>,
    pointers: Option<Vec<String>>,
}

impl SourceSpec {
    /// Refuses the fields that are given but not in `takes`.
    fn only(&self, takes: &[&str]) -> Result<(), String> {
        let given = [
            ("name", self.name.is_some()),
            ("pointer", self.pointer.is_some()),
            ("pointers", self.pointers.is_some()),
        ];
        match given.iter().find(|(f, set)| *set && !takes.contains(f)) {
            None => Ok(()),
            Some((field, _)) if takes.is_empty() => Err(format!(
                "source `{}` takes no other field, but `{field}` is given",
                self.source
            )),
            Some((field, _)) => Err(format!(
                "source `{}` takes {}, not `{field}`",
                self.source,
                takes
                    .iter()
                    .map(|t| format!("`{t}`"))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )),
        }
    }

    fn name(self) -> Result<String, String> {
        let source = self.source;
        self.name
            .ok_or_else(|| format!("source `{source}` needs `name` (the header's name)"))
    }
}

impl TryFrom<SourceSpec> for KeySource {
    type Error = String;

    fn try_from(s: SourceSpec) -> Result<KeySource, String> {
        match s.source.as_str() {
            "id" => s.only(&[]).map(|_| KeySource::Id),
            "cloudevents" => s.only(&[]).map(|_| KeySource::Cloudevents),
            "content_hash" => s.only(&[]).map(|_| KeySource::ContentHash),
            "header" => {
                s.only(&["name"])?;
                Ok(KeySource::Header { name: s.name()? })
            }
            "json_pointer" => {
                s.only(&["pointer", "pointers"])?;
                Ok(KeySource::JsonPointer {
                    pointer: s.pointer.unwrap_or_default(),
                    pointers: s.pointers.unwrap_or_default(),
                })
            }
            other => Err(format!(
                "unknown key source `{other}`: use id, header, json_pointer, cloudevents or content_hash"
            )),
        }
    }
}

impl TryFrom<SourceSpec> for PartitionSource {
    type Error = String;

    fn try_from(s: SourceSpec) -> Result<PartitionSource, String> {
        match s.source.as_str() {
            "idempotency_key" => s.only(&[]).map(|_| PartitionSource::IdempotencyKey),
            "envelope_key" => s.only(&[]).map(|_| PartitionSource::EnvelopeKey),
            "header" => {
                s.only(&["name"])?;
                Ok(PartitionSource::Header { name: s.name()? })
            }
            "json_pointer" => {
                s.only(&["pointer"])?;
                let source = s.source.clone();
                Ok(PartitionSource::JsonPointer {
                    pointer: s
                        .pointer
                        .ok_or_else(|| format!("source `{source}` needs `pointer`"))?,
                })
            }
            other => Err(format!(
                "unknown partition key source `{other}`: use idempotency_key, envelope_key, header or json_pointer"
            )),
        }
    }
}
