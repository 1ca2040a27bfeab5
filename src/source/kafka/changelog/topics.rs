//! The changelog topic: its name, its partition count, and its creation (compacted).

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::Consumer;
use rdkafka::types::RDKafkaErrorCode;

use crate::source::kafka::{client_config, KafkaConfig, KafkaError};

/// The changelog topic of a subscriber.
pub(crate) fn topic_name(prefix: &str, subscriber: &str) -> String {
    format!("{prefix}-{subscriber}-changelog")
}

/// The partition count of `topic` (`None`: the cluster does not know it).
pub(crate) fn partition_count<C: rdkafka::consumer::ConsumerContext, K: Consumer<C>>(
    consumer: &K,
    topic: &str,
) -> Result<Option<usize>, KafkaError> {
    let meta = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .map_err(|source| KafkaError::Client {
            what: format!("metadata of {topic}"),
            source,
        })?;
    Ok(meta
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len())
        .filter(|n| *n > 0))
}

/// Creates the changelog topic: compacted, `partitions` partitions. One that exists
/// already is left as it is.
pub(crate) fn create_topic(
    kafka: &KafkaConfig,
    topic: &str,
    partitions: usize,
) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> =
        client_config(kafka)
            .create()
            .map_err(|source| KafkaError::Client {
                what: "admin client".into(),
                source,
            })?;
    let new = NewTopic::new(
        topic,
        partitions as i32,
        TopicReplication::Fixed(kafka.changelog.replication_factor),
    )
    .set("cleanup.policy", "compact");
    let opts = AdminOptions::new()
        .operation_timeout(Some(Duration::from_secs(10)))
        .request_timeout(Some(Duration::from_secs(15)));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(KafkaError::Runtime)?;
    let failed = |source| KafkaError::TopicCreation {
        topic: topic.to_string(),
        partitions,
        source,
    };
    let created = runtime
        .block_on(admin.create_topics([&new], &opts))
        .map_err(failed)?;
    for result in created {
        match result {
            Ok(_) => {
                tracing::info!(%topic, partitions, "changelog topic created (cleanup.policy=compact)")
            }
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => return Err(failed(rdkafka::error::KafkaError::AdminOp(code))),
        }
    }
    Ok(())
}
