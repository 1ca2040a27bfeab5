//! `dedupd config check`: everything `dedupd run` checks before it accepts a message,
//! without a data directory and without a network connection.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::limits_of;
use crate::config::{Config, ConfigError, KeySource, PartitionSource, SubscriberSettings};
use crate::handler::{Component, HandlerError, Limits};
use crate::ledger::Placement;
use crate::source::kafka::{self, KafkaError};
use crate::source::mqtt::{self, MqttError};
use crate::source::nats::{self, NatsError};
use crate::source::rabbitmq::{self, RabbitMqError};

/// Why a configuration would not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// The file is unreadable, not TOML, or a field is out of range.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A handler component is missing or not a valid dedupd handler.
    #[error("{owner}: handler: {source}")]
    Handler {
        /// `subscriber "NAME"` or `defaults`.
        owner: String,
        /// The component (also named in `source`).
        path: PathBuf,
        source: HandlerError,
    },
    /// librdkafka refused an option of the `[kafka]` section.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// The `[nats]` section's client options could not be built (a credentials file).
    #[error(transparent)]
    Nats(#[from] NatsError),
    /// The `[mqtt]` section's password variable or TLS files are unusable.
    #[error(transparent)]
    Mqtt(#[from] MqttError),
    /// The `[rabbitmq]` section's TLS files could not be read.
    #[error(transparent)]
    RabbitMq(#[from] RabbitMqError),
}

/// What a valid configuration would run.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigReport {
    /// Configured subscribers, then `defaults` (what unlisted subscribers get), if they
    /// are allowed.
    pub(crate) subscribers: Vec<SubscriberReport>,
    /// Sources `dedupd run` starts: `kafka`, `nats`, `mqtt`, `rabbitmq`, `http`, `stdin`.
    pub(crate) sources: Vec<&'static str>,
    /// Where the HTTP API would listen (not bound by the check).
    pub(crate) http_bind: Option<SocketAddr>,
    /// Kafka subscriptions as `subscriber <- topic, topic`.
    pub(crate) kafka_subscriptions: Vec<String>,
    /// NATS bindings as `subscriber <- stream/durable`.
    pub(crate) nats_bindings: Vec<String>,
    /// MQTT subscriptions as `subscriber <- filter, filter`.
    pub(crate) mqtt_subscriptions: Vec<String>,
    /// RabbitMQ bindings as `subscriber <- queue`.
    pub(crate) rabbitmq_bindings: Vec<String>,
}

/// One subscriber as it would run.
#[derive(Debug, Clone, Serialize)]
pub struct SubscriberReport {
    pub(crate) name: String,
    pub(crate) key: String,
    pub(crate) placement: String,
    /// The component's path, or `None` for claims only.
    pub(crate) handler: Option<PathBuf>,
}

/// Loads `path` and checks it like [`check`].
pub fn check_file(path: &Path) -> Result<ConfigReport, CheckError> {
    check(&Config::load(path)?)
}

/// Checks everything `dedupd run` would check before accepting a message: the config's
/// own rules, every handler component it names (compiled and checked against the
/// contract with the subscriber's limits), the `[http]` rules (the port is not bound) and
/// the `[kafka]` options (clients are created, never connected). Touches no data directory.
pub fn check(config: &Config) -> Result<ConfigReport, CheckError> {
    config.validate()?;
    let mut loaded: HashSet<(PathBuf, Limits)> = HashSet::new();
    let mut load = |owner: String, path: &PathBuf, settings: &SubscriberSettings| {
        let limits = limits_of(settings);
        if loaded.contains(&(path.clone(), limits)) {
            return Ok(());
        }
        Component::load(path, limits).map_err(|source| CheckError::Handler {
            owner,
            path: path.clone(),
            source,
        })?;
        loaded.insert((path.clone(), limits));
        Ok::<(), CheckError>(())
    };
    let mut subscribers = Vec::new();
    for sub in &config.subscribers {
        let settings = sub.resolve(&config.defaults);
        if let Some(path) = &settings.handler {
            load(format!("subscriber {:?}", sub.name), path, &settings)?;
        }
        subscribers.push(SubscriberReport::of(&sub.name, &settings));
    }
    if let Some(path) = &config.defaults.handler {
        load("defaults".into(), path, &config.defaults)?;
    }
    if config.allow_unknown_subscribers {
        subscribers.push(SubscriberReport::of("(others: defaults)", &config.defaults));
    }
    let http_bind = match &config.http {
        Some(http) => {
            http.resolve_token()?;
            Some(http.bind)
        }
        None => None,
    };
    let mut kafka_subscriptions = Vec::new();
    if let Some(k) = &config.kafka {
        kafka::check_clients(k)?;
        for s in &k.subscriptions {
            kafka_subscriptions.push(format!("{} <- {}", s.subscriber, s.topics.join(", ")));
        }
    }
    let mut nats_bindings = Vec::new();
    if let Some(n) = &config.nats {
        nats::check_options(n)?;
        for b in &n.bindings {
            nats_bindings.push(format!("{} <- {}/{}", b.subscriber, b.stream, b.durable));
        }
    }
    let mut mqtt_subscriptions = Vec::new();
    if let Some(m) = &config.mqtt {
        mqtt::check_options(m)?;
        for s in &m.subscriptions {
            mqtt_subscriptions.push(format!("{} <- {}", s.subscriber, s.topics.join(", ")));
        }
    }
    let mut rabbitmq_bindings = Vec::new();
    if let Some(r) = &config.rabbitmq {
        rabbitmq::check_options(r)?;
        for b in &r.bindings {
            rabbitmq_bindings.push(format!("{} <- {}", b.subscriber, b.queue));
        }
    }
    // Validation refuses more than one broker section.
    let broker = [
        ("kafka", config.kafka.is_some()),
        ("nats", config.nats.is_some()),
        ("mqtt", config.mqtt.is_some()),
        ("rabbitmq", config.rabbitmq.is_some()),
    ]
    .into_iter()
    .find_map(|(name, present)| present.then_some(name));
    let sources = match (broker, &config.http) {
        (Some(b), Some(_)) => vec![b, "http"],
        (Some(b), None) => vec![b],
        (None, Some(_)) => vec!["http", "stdin"],
        (None, None) => vec!["stdin"],
    };
    Ok(ConfigReport {
        subscribers,
        sources,
        http_bind,
        kafka_subscriptions,
        nats_bindings,
        mqtt_subscriptions,
        rabbitmq_bindings,
    })
}

impl SubscriberReport {
    fn of(name: &str, s: &SubscriberSettings) -> SubscriberReport {
        let key = match &s.key {
            KeySource::Id => "id".to_string(),
            KeySource::Header { name } => format!("header {name}"),
            KeySource::JsonPointer { pointer, pointers } if pointers.is_empty() => {
                format!("json_pointer {pointer}")
            }
            KeySource::JsonPointer { pointers, .. } => {
                format!("json_pointer [{}]", pointers.join(", "))
            }
            KeySource::Cloudevents => "cloudevents".to_string(),
            KeySource::ContentHash => "content_hash".to_string(),
        };
        let entity = match &s.partition_key {
            PartitionSource::IdempotencyKey => None,
            PartitionSource::EnvelopeKey => Some("envelope key".to_string()),
            PartitionSource::Header { name } => Some(format!("header {name}")),
            PartitionSource::JsonPointer { pointer } => Some(format!("json_pointer {pointer}")),
        };
        let placement = match (Placement::of(s.handler.is_some(), entity.is_some()), entity) {
            (Placement::ByKey, _) => "by key".to_string(),
            (Placement::Subscriber, _) => "one shard (no partition key)".to_string(),
            (Placement::Entity, entity) => {
                format!("by entity ({})", entity.unwrap_or_default())
            }
        };
        SubscriberReport {
            name: name.to_string(),
            key,
            placement,
            handler: s.handler.clone(),
        }
    }
}

impl fmt::Display for ConfigReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "config ok")?;
        for s in &self.subscribers {
            let handler = match &s.handler {
                Some(h) => format!("handler {} (checked)", h.display()),
                None => "no handler (claims only)".to_string(),
            };
            writeln!(
                f,
                "subscriber {:<20} key {}; placement {}; {handler}",
                s.name, s.key, s.placement
            )?;
        }
        writeln!(f, "sources    {}", self.sources.join(", "))?;
        for s in &self.kafka_subscriptions {
            writeln!(f, "kafka      {s} (options accepted; not connected)")?;
        }
        for s in &self.nats_bindings {
            writeln!(f, "nats       {s} (options accepted; not connected)")?;
        }
        for s in &self.mqtt_subscriptions {
            writeln!(f, "mqtt       {s} (options accepted; not connected)")?;
        }
        for s in &self.rabbitmq_bindings {
            writeln!(f, "rabbitmq   {s} (options accepted; not connected)")?;
        }
        if let Some(bind) = self.http_bind {
            writeln!(f, "http       {bind} (token rules checked; not bound)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_config_reports_stdin_and_the_defaults() {
        let report = check(&Config::default()).unwrap();
        assert_eq!(report.sources, vec!["stdin"]);
        assert_eq!(report.subscribers.len(), 1);
        assert_eq!(report.subscribers[0].placement, "by key");
        assert!(report.to_string().starts_with("config ok\n"), "{report}");
    }

    #[test]
    fn missing_handler_names_the_subscriber() {
        let config = Config::parse(
            "[[subscriber]]\nname = \"orders\"\nhandler = \"no/such/handler.wasm\"\n",
        )
        .unwrap();
        let err = check(&config).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "subscriber \"orders\": handler: cannot read handler no/such/handler.wasm: "
            ),
            "{err}"
        );
    }
}
