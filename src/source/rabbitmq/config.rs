//! The `[rabbitmq]` section of the config file, and its offline checks.

use std::num::{NonZeroU16, NonZeroUsize};
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::broker::{at_least_100ms, bound_subscriber, tls_files};
use crate::config::{invalid, Config, ConfigError};

/// The RabbitMQ source: queues consumed over AMQP 0-9-1, feeding subscribers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqConfig {
    /// The server: `amqp://host:5672/vhost` or `amqps://host:5671/vhost` (TLS). Query
    /// parameters of the AMQP URI spec apply (`?heartbeat=10`). Put no password here:
    /// give `user` and `password = "${RABBITMQ_PASSWORD}"` instead.
    pub(crate) uri: String,
    /// User name (overrides the URI's; else the URI's, else `guest`).
    #[serde(default)]
    pub(crate) user: Option<String>,
    /// The user's password, usually `"${RABBITMQ_PASSWORD}"` (read from the environment).
    #[serde(default)]
    pub(crate) password: Option<String>,
    /// PEM file of the CA that signed the server's certificate (`amqps://` only), trusted
    /// beside the system's roots (lapin adds it to them).
    #[serde(default)]
    pub(crate) tls_ca_file: Option<PathBuf>,
    /// PEM client certificate and PKCS#8 key (mutual TLS, `amqps://` only); both or neither.
    #[serde(default)]
    pub(crate) tls_cert_file: Option<PathBuf>,
    #[serde(default)]
    pub(crate) tls_key_file: Option<PathBuf>,
    /// Connection name shown by the server (`rabbitmqctl list_connections client_properties`).
    #[serde(default = "default_name")]
    pub(crate) name: String,
    /// Longest wait for one connection attempt.
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub(crate) connect_timeout: Duration,
    /// Longest pause between reconnection attempts (the pause doubles from 100ms up to it).
    #[serde(default = "default_reconnect_delay_max", with = "humantime_serde")]
    pub(crate) reconnect_delay_max: Duration,
    /// Longest wait for in-flight work at shutdown; what is not durable by then is
    /// requeued (`basic.nack`) and delivered again.
    #[serde(default = "default_drain_timeout", with = "humantime_serde")]
    pub(crate) drain_timeout: Duration,
    /// Queues -> subscribers; one channel and one consumer per binding.
    #[serde(rename = "binding", default)]
    pub(crate) bindings: Vec<BindingConfig>,
    /// What handlers emit, published to an exchange after commit (off by default).
    #[serde(default)]
    pub(crate) outbox: RabbitOutboxConfig,
}

/// `[rabbitmq.outbox]`: the relay of what handlers emit (`emit(topic, key, headers,
/// payload)`) to an exchange, with publisher confirms.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RabbitOutboxConfig {
    /// Run the relay. While it runs, the outbox cannot be pulled over HTTP.
    pub(crate) enabled: bool,
    /// The exchange published to, with the emitted topic as the routing key. `""` (the
    /// default exchange) delivers to the queue named by the topic.
    pub(crate) exchange: String,
    /// Pause between polls of the outbox when it was empty.
    #[serde(with = "humantime_serde")]
    pub(crate) poll_interval: Duration,
    /// Rows published per round (confirmed, then deleted, as one batch).
    pub(crate) batch: NonZeroUsize,
}

impl Default for RabbitOutboxConfig {
    fn default() -> Self {
        RabbitOutboxConfig {
            enabled: false,
            exchange: String::new(),
            poll_interval: Duration::from_millis(100),
            batch: NonZeroUsize::new(1000).unwrap_or(NonZeroUsize::MIN),
        }
    }
}

/// One queue, feeding one subscriber.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BindingConfig {
    /// The subscriber (its key source, partition key and handler apply). Its `id` key
    /// source reads the `message_id` property; a `header`, `json_pointer`, `cloudevents`
    /// or `content_hash` source reads the message as for any other source.
    pub(crate) subscriber: String,
    /// The queue consumed.
    pub(crate) queue: String,
    /// Declare the queue (durable) when it does not exist. A queue that exists must have
    /// the same arguments (a different `dead_letter_queue` is refused by the server); with
    /// `false` it must exist and is used as it is (a passive declare checks it).
    #[serde(default = "yes")]
    pub(crate) declare: bool,
    /// With `declare`: a durable queue that receives what dedupd rejects (`basic.reject`
    /// without requeue), declared too and set as the queue's dead-letter target through
    /// the default exchange. Without it, a queue's own dead-letter exchange (an argument
    /// or a policy) applies, or the server drops rejected messages (dedupd keeps a
    /// dead-letter record of each in the ledger first either way).
    #[serde(default)]
    pub(crate) dead_letter_queue: Option<String>,
    /// `basic.qos` prefetch count: the messages the server sends before acknowledgements,
    /// and so the in-flight window of this binding.
    #[serde(default = "default_prefetch")]
    pub(crate) prefetch: NonZeroU16,
}

fn yes() -> bool {
    true
}
fn default_name() -> String {
    "dedupd".into()
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_reconnect_delay_max() -> Duration {
    Duration::from_secs(10)
}
fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_prefetch() -> NonZeroU16 {
    NonZeroU16::new(1024).unwrap_or(NonZeroU16::MIN)
}

impl RabbitMqConfig {
    /// A config with defaults for everything but the URI.
    pub(crate) fn new(uri: impl Into<String>) -> RabbitMqConfig {
        RabbitMqConfig {
            uri: uri.into(),
            user: None,
            password: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            name: default_name(),
            connect_timeout: default_connect_timeout(),
            reconnect_delay_max: default_reconnect_delay_max(),
            drain_timeout: default_drain_timeout(),
            bindings: Vec::new(),
            outbox: RabbitOutboxConfig::default(),
        }
    }

    /// The URI as the client takes it, with `user` and `password` applied.
    pub(crate) fn amqp_uri(&self) -> Result<lapin::uri::AMQPUri, ConfigError> {
        let mut uri: lapin::uri::AMQPUri = self.uri.parse().map_err(|e| {
            invalid(
                "rabbitmq.uri",
                format!("not an AMQP URI (amqp://host:5672/vhost or amqps://...): {e}"),
            )
        })?;
        if let Some(user) = &self.user {
            uri.authority.userinfo.username = user.clone();
        }
        if let Some(password) = &self.password {
            uri.authority.userinfo.password = password.clone();
        }
        Ok(uri)
    }

    /// Whether the URI asks for TLS (`amqps://`).
    pub(crate) fn tls(&self) -> bool {
        self.uri
            .trim_start()
            .to_ascii_lowercase()
            .starts_with("amqps://")
    }

    /// Checks the section against the rest of the config, without connecting. An error
    /// names the field (`rabbitmq.binding[0].queue`).
    pub(crate) fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        let lower = self.uri.trim_start().to_ascii_lowercase();
        if !(lower.starts_with("amqp://") || lower.starts_with("amqps://")) {
            return Err(invalid(
                "rabbitmq.uri",
                format!("{:?} must start with amqp:// or amqps:// (TLS)", self.uri),
            ));
        }
        self.amqp_uri()?;
        if self.password.is_some() && self.user.is_none() {
            return Err(invalid(
                "rabbitmq.password",
                "user and password go together",
            ));
        }
        tls_files(
            "rabbitmq",
            &self.tls_ca_file,
            &self.tls_cert_file,
            &self.tls_key_file,
            (!self.tls()).then_some("is set but the uri is amqp:// (no TLS); use amqps://"),
        )?;
        at_least_100ms(&[
            ("rabbitmq.drain_timeout", self.drain_timeout),
            ("rabbitmq.connect_timeout", self.connect_timeout),
            ("rabbitmq.reconnect_delay_max", self.reconnect_delay_max),
        ])?;
        if self.bindings.is_empty() {
            return Err(invalid(
                "rabbitmq.binding",
                "must name at least one queue ([[rabbitmq.binding]])",
            ));
        }
        self.outbox.validate()?;
        for (i, b) in self.bindings.iter().enumerate() {
            b.validate(&format!("rabbitmq.binding[{i}]"), config)?;
            if self.bindings[..i].iter().any(|o| o.queue == b.queue) {
                return Err(invalid(
                    format!("rabbitmq.binding[{i}].queue"),
                    format!("{:?} is bound twice; one binding per queue", b.queue),
                ));
            }
        }
        Ok(())
    }
}

impl RabbitOutboxConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let x = &self.exchange;
        if x.len() > 255 || x.contains(char::is_control) {
            return Err(invalid(
                "rabbitmq.outbox.exchange",
                format!("{x:?} is not an exchange name (at most 255 bytes, no control characters)"),
            ));
        }
        if self.poll_interval > Duration::from_secs(60) {
            return Err(invalid(
                "rabbitmq.outbox.poll_interval",
                "must be at most 60s",
            ));
        }
        if self.batch.get() > 100_000 {
            return Err(invalid("rabbitmq.outbox.batch", "must be at most 100000"));
        }
        Ok(())
    }
}

impl BindingConfig {
    fn validate(&self, field: &str, config: &Config) -> Result<(), ConfigError> {
        validate_queue(&format!("{field}.queue"), &self.queue, self.declare)?;
        if let Some(dlq) = &self.dead_letter_queue {
            if !self.declare {
                return Err(invalid(
                    format!("{field}.dead_letter_queue"),
                    "needs declare = true (dedupd sets it when it declares the queue); for a queue declared elsewhere set a dead-letter exchange there (an argument or a policy)",
                ));
            }
            validate_queue(&format!("{field}.dead_letter_queue"), dlq, true)?;
            if dlq == &self.queue {
                return Err(invalid(
                    format!("{field}.dead_letter_queue"),
                    "must differ from the queue (rejected messages would come back)",
                ));
            }
        }
        bound_subscriber(&format!("{field}.subscriber"), &self.subscriber, config)?;
        Ok(())
    }
}

/// Queue names: 1-255 bytes (an AMQP short string), no control characters; `amq.` is
/// reserved for the server's own queues and cannot be declared.
fn validate_queue(field: &str, name: &str, declare: bool) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > 255 || name.contains(char::is_control) {
        return Err(invalid(
            field,
            format!("{name:?} is not a queue name (1-255 bytes, no control characters)"),
        ));
    }
    if declare && name.starts_with("amq.") {
        return Err(invalid(
            field,
            format!("{name:?}: names starting with amq. are reserved by the server; declare = false to consume one"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::broker::testing::{assert_fields_named, refused};

    const BASE: &str = r#"
[rabbitmq]
uri = "amqp://127.0.0.1:5672/%2f"

[[rabbitmq.binding]]
subscriber = "orders"
queue = "orders"
"#;

    #[test]
    fn rabbitmq_section_parses_with_defaults() {
        let config = Config::parse(BASE).expect("config");
        let r = config.rabbitmq.expect("rabbitmq");
        let b = &r.bindings[0];
        assert!(b.declare);
        assert_eq!(b.prefetch.get(), 1024);
        assert_eq!(b.dead_letter_queue, None);
        assert_eq!(r.drain_timeout, Duration::from_secs(30));
        assert!(!r.tls());
        assert!(
            !r.outbox.enabled,
            "the outbox relay is asked for, not assumed"
        );
        let text = format!("{BASE}\n[rabbitmq.outbox]\nenabled = true\nexchange = \"events\"\n");
        let o = Config::parse(&text)
            .expect("config")
            .rabbitmq
            .expect("rabbitmq")
            .outbox;
        assert!(o.enabled);
        assert_eq!(o.exchange, "events");
        assert_eq!(o.batch.get(), 1000);
    }

    #[test]
    fn user_and_password_override_the_uri() {
        let text = BASE.replace(
            "uri = \"amqp://127.0.0.1:5672/%2f\"",
            "uri = \"amqps://a:b@host:5671/prod\"\nuser = \"dedupd\"\npassword = \"s3cret\"",
        );
        let r = Config::parse(&text)
            .expect("config")
            .rabbitmq
            .expect("rabbitmq");
        let uri = r.amqp_uri().expect("uri");
        assert_eq!(uri.authority.userinfo.username, "dedupd");
        assert_eq!(uri.authority.userinfo.password, "s3cret");
        assert_eq!(uri.vhost, "prod");
        assert!(r.tls());
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (
                BASE.replace("amqp://127.0.0.1:5672/%2f", "http://x:1"),
                "rabbitmq.uri",
            ),
            (
                BASE.replace("queue = \"orders\"", "queue = \"\""),
                "rabbitmq.binding[0].queue",
            ),
            (
                BASE.replace("queue = \"orders\"", "queue = \"amq.x\""),
                "rabbitmq.binding[0].queue",
            ),
            (
                BASE.replace("queue = \"orders\"", "queue = \"orders\"\nprefetch = 0"),
                "prefetch",
            ),
            (
                BASE.replace(
                    "queue = \"orders\"",
                    "queue = \"orders\"\ndead_letter_queue = \"orders\"",
                ),
                "rabbitmq.binding[0].dead_letter_queue",
            ),
            (
                BASE.replace(
                    "queue = \"orders\"",
                    "queue = \"orders\"\ndeclare = false\ndead_letter_queue = \"dlq\"",
                ),
                "rabbitmq.binding[0].dead_letter_queue",
            ),
            (
                BASE.replace("uri =", "password = \"p\"\nuri ="),
                "rabbitmq.password",
            ),
            (
                BASE.replace("uri =", "tls_ca_file = \"/nonexistent.pem\"\nuri ="),
                "rabbitmq.tls_ca_file",
            ),
            (
                BASE.replace("uri =", "drain_timeout = \"1ms\"\nuri ="),
                "rabbitmq.drain_timeout",
            ),
            (
                format!("{BASE}\n[[rabbitmq.binding]]\nsubscriber = \"x\"\nqueue = \"orders\"\n"),
                "rabbitmq.binding[1].queue",
            ),
            (
                format!("{BASE}\n[rabbitmq.outbox]\nenabled = true\nexchange = \"a\\nb\"\n"),
                "rabbitmq.outbox.exchange",
            ),
            (
                format!("{BASE}\n[rabbitmq.outbox]\npoll_interval = \"2m\"\n"),
                "rabbitmq.outbox.poll_interval",
            ),
            (format!("{BASE}\n[rabbitmq.outbox]\nbatch = 0\n"), "batch"),
        ];
        assert_fields_named(cases);
    }

    #[test]
    fn a_section_without_bindings_is_refused() {
        let e = refused("[rabbitmq]\nuri = \"amqp://127.0.0.1\"\n");
        assert!(e.contains("rabbitmq.binding"), "{e}");
    }

    #[test]
    fn a_second_broker_section_is_refused() {
        let text = format!("{BASE}\n[nats]\nservers = [\"nats://127.0.0.1:4222\"]\n[[nats.binding]]\nsubscriber = \"orders\"\nstream = \"S\"\ndurable = \"d\"\n");
        let e = refused(&text);
        assert!(e.contains("one dedupd per broker"), "{e}");
    }
}
