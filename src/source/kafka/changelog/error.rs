//! Why publishing to a changelog failed, or a record in it could not be read.

use std::time::Duration;

use rdkafka::error::KafkaError as RdError;

use super::record::RecordError;

/// Why a changelog did not take (or acknowledge) what was published to it, or why a
/// record in it could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChangelogError {
    /// A record's value could not be encoded or decoded.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// A message from another source reached a subscriber with a changelog.
    #[error("message {id:?} did not come from Kafka: a changelog takes only Kafka messages")]
    NotKafka { id: String },
    /// The producer refused a record before sending it.
    #[error("producing to {topic}: {source}")]
    Produce {
        topic: String,
        #[source]
        source: RdError,
    },
    /// A fence was acknowledged without its offset, so its epoch is unknown.
    #[error("no offset reported for the fence of {topic}/{partition}")]
    NoFenceOffset { topic: String, partition: i32 },
    /// The broker did not acknowledge every record within the publish timeout.
    #[error("{left} of {count} changes not acknowledged by {topic} within {timeout:?}")]
    NotAcknowledged {
        left: usize,
        count: usize,
        topic: String,
        timeout: Duration,
    },
    /// The broker refused a record (the first refusal of a batch).
    #[error("{topic} refused a change: {source}")]
    Refused {
        topic: String,
        #[source]
        source: RdError,
    },
}
