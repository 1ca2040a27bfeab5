//! `dedupd dev-broker`: librdkafka's mock cluster on loopback, for development and tests.
//! It speaks the real Kafka protocol over TCP (produce, fetch, consumer groups, committed
//! offsets), auto-creates topics with 4 partitions, and keeps everything in memory.

use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

use super::KafkaError;

/// A running mock cluster; stops when dropped.
pub struct DevBroker {
    cluster: MockCluster<'static, DefaultProducerContext>,
}

impl DevBroker {
    /// Starts a cluster of `brokers` brokers on loopback ports.
    pub fn start(brokers: i32) -> Result<DevBroker, KafkaError> {
        let cluster = MockCluster::new(brokers.max(1)).map_err(|source| KafkaError::Client {
            what: "cannot start the mock cluster".into(),
            source,
        })?;
        Ok(DevBroker { cluster })
    }

    /// `bootstrap.servers` for clients.
    pub fn bootstrap_servers(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// Creates a topic with `partitions` partitions (otherwise topics are auto-created
    /// with 4).
    pub fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), KafkaError> {
        self.cluster
            .create_topic(topic, partitions, 1)
            .map_err(|source| KafkaError::Client {
                what: format!("cannot create topic {topic}"),
                source,
            })
    }
}
