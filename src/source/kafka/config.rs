//! The `[kafka]` section of the config file.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::broker::{at_least_100ms, bound_subscriber};
use crate::config::{invalid, Config, ConfigError, KeySource};

/// librdkafka options dedupd sets itself; overriding them would break G1.
const MANAGED_OPTIONS: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.auto.offset.store",
    "enable.auto.commit",
    "auto.commit.interval.ms",
    "auto.offset.reset",
    "enable.idempotence",
    "acks",
];

/// Where a consumer group without committed offsets starts reading.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum StartPosition {
    /// The oldest retained message.
    #[default]
    Earliest,
    /// Only messages produced after the group first joined.
    Latest,
}

impl StartPosition {
    pub(crate) fn as_librdkafka(self) -> &'static str {
        match self {
            StartPosition::Earliest => "earliest",
            StartPosition::Latest => "latest",
        }
    }
}

/// The Kafka source: consumer groups feeding subscribers, a dead-letter topic and the
/// outbox relay.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers`: comma-separated `host:port` list.
    pub(crate) brokers: String,
    /// Consumer group of subscriptions that name none.
    #[serde(default = "default_group")]
    pub(crate) group: String,
    /// Where a group without committed offsets starts: `earliest` or `latest`.
    #[serde(default)]
    pub(crate) start: StartPosition,
    /// Topic that receives dead-lettered and rejected messages (none: they stay in the
    /// ledger only).
    #[serde(default)]
    pub dead_letter_topic: Option<String>,
    /// Messages of one partition in flight (received, outcome not yet durable) before the
    /// partition is paused; it resumes at half.
    #[serde(default = "default_max_in_flight")]
    pub(crate) max_in_flight_per_partition: NonZeroUsize,
    /// How often stored offsets are committed to the group coordinator.
    #[serde(default = "default_commit_interval", with = "humantime_serde")]
    pub commit_interval: Duration,
    /// `session.timeout.ms`: how long the group waits for a silent member.
    #[serde(default = "default_session_timeout", with = "humantime_serde")]
    pub session_timeout: Duration,
    /// Longest wait for in-flight work when partitions are revoked or at shutdown.
    #[serde(default = "default_drain_timeout", with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// Raw librdkafka options for every client (security passthrough: `security.protocol`,
    /// `sasl.*`, `ssl.*`, `client.id`, ...). Options dedupd manages are refused.
    #[serde(default)]
    pub(crate) options: BTreeMap<String, String>,
    /// The outbox relay.
    #[serde(default)]
    pub outbox: OutboxRelayConfig,
    /// Where subscriptions with `changelog = true` publish (see [`ChangelogConfig`]).
    #[serde(default)]
    pub(crate) changelog: ChangelogConfig,
    /// Topics -> subscriber; one consumer group member per subscription.
    #[serde(rename = "subscription", default)]
    pub subscriptions: Vec<SubscriptionConfig>,
}

/// One consumer: topics whose messages go to one subscriber.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubscriptionConfig {
    /// The subscriber (its key source, partition key and handler apply).
    pub subscriber: String,
    /// Topics to consume.
    pub topics: Vec<String>,
    /// Consumer group (default: `kafka.group`).
    #[serde(default)]
    pub group: Option<String>,
    /// Publish every processed message's claim and handler state to a compacted changelog
    /// topic and restore assigned partitions from it, so claims and state follow their
    /// partitions between the instances of one consumer group (docs/kafka.md, "Several
    /// instances: the changelog"). One topic per subscription.
    #[serde(default)]
    pub changelog: bool,
}

/// Relays handler outbox rows to Kafka after commit.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxRelayConfig {
    /// Run the relay.
    pub(crate) enabled: bool,
    /// Pause between polls of the outbox when it was empty.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Rows produced per round (acknowledged as one batch).
    pub(crate) batch: NonZeroUsize,
}

impl Default for OutboxRelayConfig {
    fn default() -> Self {
        OutboxRelayConfig {
            enabled: true,
            poll_interval: Duration::from_millis(100),
            batch: NonZeroUsize::new(1000).unwrap_or(NonZeroUsize::MIN),
        }
    }
}

/// `[kafka.changelog]`: the topics of subscriptions with `changelog = true`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct ChangelogConfig {
    /// Topics are named `<prefix>-<subscriber>-changelog`.
    pub(crate) prefix: String,
    /// Replication factor of a changelog topic dedupd creates (-1: the broker's default).
    pub(crate) replication_factor: i32,
    /// How long a batch waits for the changelog's acknowledgements before the ledger stops.
    #[serde(with = "humantime_serde")]
    pub(crate) publish_timeout: Duration,
    /// How long restoring newly assigned partitions may take before the subscription stops.
    /// The restore runs inside the consumer's poll (the rebalance callback), so it must
    /// end within `max.poll.interval.ms` or the member leaves the group.
    #[serde(with = "humantime_serde")]
    pub(crate) restore_timeout: Duration,
    /// How often the checkpoints of owned partitions move (a restart after a crash
    /// replays the changelog from the last one).
    #[serde(with = "humantime_serde")]
    pub(crate) checkpoint_interval: Duration,
    /// How often the partitions this member owns are compacted: the handler state every
    /// expired claim wrote is published again as snapshots, then its record gets a
    /// tombstone, so the broker's log cleaner can drop it.
    #[serde(with = "humantime_serde")]
    pub(crate) compaction_interval: Duration,
    /// How long past its expiry a claim waits for its tombstone: a margin for clocks that
    /// differ between members (a restore skips a claim its own clock says has expired).
    #[serde(with = "humantime_serde")]
    pub(crate) expiry_grace: Duration,
}

impl Default for ChangelogConfig {
    fn default() -> Self {
        ChangelogConfig {
            prefix: "dedupd".into(),
            replication_factor: -1,
            publish_timeout: Duration::from_secs(30),
            restore_timeout: Duration::from_secs(240),
            checkpoint_interval: Duration::from_secs(10),
            compaction_interval: Duration::from_secs(30),
            expiry_grace: Duration::from_secs(60),
        }
    }
}

fn default_group() -> String {
    "dedupd".into()
}
fn default_max_in_flight() -> NonZeroUsize {
    NonZeroUsize::new(16_384).unwrap_or(NonZeroUsize::MIN)
}
fn default_commit_interval() -> Duration {
    Duration::from_secs(1)
}
fn default_session_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}

impl KafkaConfig {
    /// A config with defaults for everything but the brokers.
    pub fn new(brokers: impl Into<String>) -> KafkaConfig {
        KafkaConfig {
            brokers: brokers.into(),
            group: default_group(),
            start: StartPosition::default(),
            dead_letter_topic: None,
            max_in_flight_per_partition: default_max_in_flight(),
            commit_interval: default_commit_interval(),
            session_timeout: default_session_timeout(),
            drain_timeout: default_drain_timeout(),
            options: BTreeMap::new(),
            outbox: OutboxRelayConfig::default(),
            changelog: ChangelogConfig::default(),
            subscriptions: Vec::new(),
        }
    }

    /// The group a subscription joins.
    pub(crate) fn group_of<'a>(&'a self, sub: &'a SubscriptionConfig) -> &'a str {
        sub.group.as_deref().unwrap_or(&self.group)
    }

    /// Checks the section against the rest of the config (subscribers must be keyable from
    /// a Kafka record).
    pub(crate) fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        if self.brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must name at least one host:port"));
        }
        if self.group.is_empty() {
            return Err(invalid("kafka.group", "must not be empty"));
        }
        if let Some(t) = &self.dead_letter_topic {
            validate_topic("kafka.dead_letter_topic", t)?;
        }
        for name in self.options.keys() {
            if MANAGED_OPTIONS.contains(&name.as_str()) {
                return Err(invalid(
                    format!("kafka.options.{name}"),
                    "is set by dedupd itself (offsets are stored only after durable commit); use the dedicated kafka.* field if there is one",
                ));
            }
        }
        if self.commit_interval < Duration::from_millis(10)
            || self.commit_interval > Duration::from_secs(3600)
        {
            return Err(invalid(
                "kafka.commit_interval",
                "must be between 10ms and 1h",
            ));
        }
        if self.session_timeout < Duration::from_secs(1)
            || self.session_timeout > Duration::from_secs(3600)
        {
            return Err(invalid(
                "kafka.session_timeout",
                "must be between 1s and 1h",
            ));
        }
        at_least_100ms(&[("kafka.drain_timeout", self.drain_timeout)])?;
        if self.subscriptions.iter().any(|s| s.changelog) {
            let c = &self.changelog;
            validate_topic(
                "kafka.changelog.prefix",
                &format!("{}-x-changelog", c.prefix),
            )?;
            if c.replication_factor == 0 || c.replication_factor < -1 {
                return Err(invalid(
                    "kafka.changelog.replication_factor",
                    "must be -1 (the broker's default) or at least 1",
                ));
            }
            if c.publish_timeout < Duration::from_secs(1) {
                return Err(invalid(
                    "kafka.changelog.publish_timeout",
                    "must be at least 1s",
                ));
            }
            if c.restore_timeout < Duration::from_secs(1) {
                return Err(invalid(
                    "kafka.changelog.restore_timeout",
                    "must be at least 1s",
                ));
            }
            let max_poll_ms = self
                .options
                .get("max.poll.interval.ms")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(300_000);
            if c.restore_timeout.as_millis() as u64 >= max_poll_ms {
                return Err(invalid(
                    "kafka.changelog.restore_timeout",
                    format!(
                        "must be shorter than max.poll.interval.ms ({max_poll_ms} ms): a restore runs inside the consumer's poll, and a member that does not poll for that long leaves the group; raise kafka.options.\"max.poll.interval.ms\" for longer restores"
                    ),
                ));
            }
            at_least_100ms(&[
                ("kafka.changelog.checkpoint_interval", c.checkpoint_interval),
                ("kafka.changelog.compaction_interval", c.compaction_interval),
            ])?;
        }
        if self.outbox.poll_interval > Duration::from_secs(60) {
            return Err(invalid("kafka.outbox.poll_interval", "must be at most 60s"));
        }
        for (i, s) in self.subscriptions.iter().enumerate() {
            let field = format!("kafka.subscription[{i}]");
            if s.topics.is_empty() {
                return Err(invalid(format!("{field}.topics"), "must name a topic"));
            }
            for t in &s.topics {
                validate_topic(&format!("{field}.topics"), t)?;
            }
            if s.changelog && s.topics.len() != 1 {
                return Err(invalid(
                    format!("{field}.changelog"),
                    "needs exactly one topic in `topics`: partition p of the changelog holds the changes of the topic's partition p (use one subscription per topic)",
                ));
            }
            if s.group.as_deref() == Some("") {
                return Err(invalid(format!("{field}.group"), "must not be empty"));
            }
            let settings = bound_subscriber(&format!("{field}.subscriber"), &s.subscriber, config)?;
            if settings.key == KeySource::Id {
                return Err(invalid(
                    format!("{field}.subscriber"),
                    format!(
                        "subscriber {:?} takes its idempotency key from the envelope `id`, which Kafka records do not have; set its `key` to a header, json_pointer, cloudevents or content_hash source",
                        s.subscriber
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn validate_topic(field: &str, topic: &str) -> Result<(), ConfigError> {
    let ok = !topic.is_empty()
        && topic.len() <= 249
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{topic:?} is not a valid Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(text)
    }

    const BASE: &str = r#"
[[subscriber]]
name = "billing"
key = { source = "header", name = "message-id" }

[kafka]
brokers = "127.0.0.1:9092"
"#;

    #[test]
    fn kafka_section_parses_with_defaults() {
        let text = format!(
            "{BASE}\n[[kafka.subscription]]\nsubscriber = \"billing\"\ntopics = [\"orders\"]\n"
        );
        let config = parse(&text).expect("config");
        let k = config.kafka.expect("kafka");
        assert_eq!(k.group, "dedupd");
        assert_eq!(k.start, StartPosition::Earliest);
        assert_eq!(k.subscriptions[0].topics, vec!["orders".to_string()]);
        assert!(k.outbox.enabled);
    }

    #[test]
    fn managed_option_is_refused() {
        let text = format!("{BASE}options = {{ \"enable.auto.offset.store\" = \"true\" }}\n");
        let err = parse(&text).unwrap_err();
        assert!(
            err.to_string()
                .contains("kafka.options.enable.auto.offset.store"),
            "{err}"
        );
    }

    #[test]
    fn security_options_pass_through() {
        let text = format!("{BASE}options = {{ \"security.protocol\" = \"SASL_SSL\", \"sasl.mechanism\" = \"PLAIN\" }}\n");
        let k = parse(&text).expect("config").kafka.expect("kafka");
        assert_eq!(k.options["sasl.mechanism"], "PLAIN");
    }

    #[test]
    fn subscriber_keyed_by_envelope_id_is_refused() {
        let text = "[kafka]\nbrokers = \"b:9092\"\n[[kafka.subscription]]\nsubscriber = \"x\"\ntopics = [\"t\"]\n";
        let err = parse(text).unwrap_err();
        assert!(
            err.to_string().contains("kafka.subscription[0].subscriber"),
            "{err}"
        );
    }

    #[test]
    fn bad_topic_is_refused() {
        let text = format!(
            "{BASE}\n[[kafka.subscription]]\nsubscriber = \"billing\"\ntopics = [\"a b\"]\n"
        );
        let err = parse(&text).unwrap_err();
        assert!(
            err.to_string().contains("kafka.subscription[0].topics"),
            "{err}"
        );
    }

    #[test]
    fn unknown_kafka_field_is_refused() {
        let err = parse(&format!("{BASE}brokerz = 1\n")).unwrap_err();
        assert!(err.to_string().contains("brokerz"), "{err}");
    }

    const CHANGELOG_SUB: &str =
        "\n[[kafka.subscription]]\nsubscriber = \"billing\"\ntopics = [\"orders\"]\nchangelog = true\n";

    #[test]
    fn a_changelog_takes_one_topic_and_a_restore_shorter_than_the_poll_interval() {
        let ok = parse(&format!("{BASE}{CHANGELOG_SUB}")).expect("defaults are consistent");
        let k = ok.kafka.expect("kafka section");
        assert!(k.subscriptions[0].changelog);
        assert_eq!(k.changelog.prefix, "dedupd");
        let two = CHANGELOG_SUB.replace("[\"orders\"]", "[\"orders\", \"refunds\"]");
        let err = parse(&format!("{BASE}{two}")).unwrap_err().to_string();
        assert!(err.contains("exactly one topic"), "{err}");
        let long = format!("{BASE}\n[kafka.changelog]\nrestore_timeout = \"6m\"\n{CHANGELOG_SUB}");
        let err = parse(&long).unwrap_err().to_string();
        assert!(err.contains("max.poll.interval.ms"), "{err}");
        let raised = format!(
            "{BASE}options = {{ \"max.poll.interval.ms\" = \"900000\" }}\n[kafka.changelog]\nrestore_timeout = \"6m\"\n{CHANGELOG_SUB}"
        );
        parse(&raised).expect("a longer poll interval allows a longer restore");
        let zero_rf = format!("{BASE}\n[kafka.changelog]\nreplication_factor = 0\n{CHANGELOG_SUB}");
        let err = parse(&zero_rf).unwrap_err().to_string();
        assert!(err.contains("replication_factor"), "{err}");
        let spin =
            format!("{BASE}\n[kafka.changelog]\ncompaction_interval = \"0s\"\n{CHANGELOG_SUB}");
        let err = parse(&spin).unwrap_err().to_string();
        assert!(err.contains("kafka.changelog.compaction_interval"), "{err}");
    }
}
