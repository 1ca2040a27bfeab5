//! The `[mqtt]` section of the config file, and its offline checks.

use std::num::NonZeroU16;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::broker::{at_least_100ms, bound_subscriber, tls_files};
use crate::config::{invalid, Config, ConfigError, KeySource};

/// The MQTT protocol version the session speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Protocol {
    /// MQTT 3.1.1: no user properties (a `header` key source finds nothing), the broker's
    /// `max_inflight_messages` bounds what it sends unacknowledged.
    #[serde(rename = "3.1.1")]
    V311,
    /// MQTT 5: user properties are headers, `receive_maximum` is sent to the broker, the
    /// session has an expiry.
    #[serde(rename = "5")]
    V5,
}

/// The MQTT source: one persistent session on one broker, feeding subscribers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttConfig {
    /// The broker: `mqtt://host:1883` or `mqtts://host:8883` (TLS).
    pub(crate) broker: String,
    /// `"3.1.1"` (default) or `"5"`.
    #[serde(default = "default_protocol")]
    pub(crate) protocol: Protocol,
    /// The client id, the name of the persistent session: the broker keeps its
    /// subscriptions and unacknowledged messages under it while dedupd is away. Stable
    /// across restarts; one instance per id (a second connection takes the session over).
    pub(crate) client_id: String,
    /// User name (the broker's password file or auth plugin).
    #[serde(default)]
    pub(crate) username: Option<String>,
    /// The environment variable holding the password (never the password itself).
    #[serde(default)]
    pub(crate) password_env: Option<String>,
    /// PEM file of the CA that signed the broker's certificate (else the system's roots).
    #[serde(default)]
    pub(crate) tls_ca_file: Option<PathBuf>,
    /// PEM client certificate and key (mutual TLS); both or neither.
    #[serde(default)]
    pub(crate) tls_cert_file: Option<PathBuf>,
    #[serde(default)]
    pub(crate) tls_key_file: Option<PathBuf>,
    /// Keep-alive interval: the broker drops a session silent for 1.5 times it.
    #[serde(default = "default_keep_alive", with = "humantime_serde")]
    pub(crate) keep_alive: Duration,
    /// MQTT 5: how long the broker keeps the session (its subscriptions and the messages
    /// queued for it) after dedupd disconnects. MQTT 3.1.1 sessions do not expire by the
    /// protocol (see the broker's `persistent_client_expiration`).
    #[serde(default = "default_session_expiry", with = "humantime_serde")]
    pub(crate) session_expiry: Duration,
    /// The in-flight window: messages held unacknowledged. MQTT 5 sends it to the broker
    /// as Receive Maximum; with 3.1.1 set the broker's `max_inflight_messages` to at most
    /// this (dedupd stops reading the connection while the window is full).
    #[serde(default = "default_receive_maximum")]
    pub(crate) receive_maximum: NonZeroU16,
    /// The largest packet accepted. MQTT 5 tells the broker, which then drops bigger
    /// messages for this session; with 3.1.1 a bigger message breaks the connection, so
    /// set the broker's `message_size_limit` to at most this.
    #[serde(default = "default_max_packet_bytes")]
    pub(crate) max_packet_bytes: u32,
    /// Longest wait for a TCP (and TLS) connection and the broker's CONNACK.
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub(crate) connect_timeout: Duration,
    /// Longest pause between reconnection attempts (the pause doubles from 100 ms).
    #[serde(default = "default_reconnect_max", with = "humantime_serde")]
    pub(crate) reconnect_backoff_max: Duration,
    /// Longest wait for in-flight work at shutdown; what is not durable by then stays
    /// unacknowledged in the session and is delivered again at the next start.
    #[serde(default = "default_drain_timeout", with = "humantime_serde")]
    pub(crate) drain_timeout: Duration,
    /// Topic filters -> subscribers.
    #[serde(rename = "subscription", default)]
    pub(crate) subscriptions: Vec<SubscriptionConfig>,
}

/// Topic filters of the session feeding one subscriber.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SubscriptionConfig {
    /// The subscriber (its key source, partition key and handler apply).
    pub subscriber: String,
    /// Topic filters (`sensors/+/reading`, `orders/#`), or shared subscriptions
    /// (`$share/<group>/<filter>`) that spread messages over the instances of a group.
    pub topics: Vec<String>,
    /// The subscription's QoS: 1 (at least once). QoS 2 is refused (see docs/mqtt.md).
    #[serde(default = "default_qos")]
    pub(crate) qos: u8,
    /// The topic level (0-based) that is the message's `id`, read by an `id` key source:
    /// 1 in `orders/A-17/created` is `A-17`.
    #[serde(default)]
    pub(crate) id_topic_level: Option<usize>,
}

fn default_protocol() -> Protocol {
    Protocol::V311
}
fn default_keep_alive() -> Duration {
    Duration::from_secs(30)
}
fn default_session_expiry() -> Duration {
    Duration::from_secs(7 * 24 * 3600)
}
fn default_receive_maximum() -> NonZeroU16 {
    NonZeroU16::new(256).unwrap_or(NonZeroU16::MIN)
}
fn default_max_packet_bytes() -> u32 {
    1 << 20
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_reconnect_max() -> Duration {
    Duration::from_secs(10)
}
fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_qos() -> u8 {
    1
}

/// Where the broker is, from `mqtt.broker`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BrokerAddr {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) tls: bool,
}

/// Why `mqtt.broker` is not a broker URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum BrokerUrlError {
    #[error("{url:?} is not a broker URL (mqtt://host:1883 or mqtts://host:8883)")]
    Scheme { url: String },
    #[error("{url:?}: the port {port:?} is not a number")]
    Port { url: String, port: String },
    #[error("{url:?}: no usable host name")]
    Host { url: String },
}

impl BrokerAddr {
    /// `mqtt://host[:1883]` or `mqtts://host[:8883]`.
    pub(crate) fn parse(url: &str) -> Result<BrokerAddr, BrokerUrlError> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("mqtts://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("mqtt://") {
            (false, r)
        } else {
            return Err(BrokerUrlError::Scheme { url: url.into() });
        };
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
                h,
                p.parse::<u16>().map_err(|_| BrokerUrlError::Port {
                    url: url.into(),
                    port: p.into(),
                })?,
            ),
            _ => (rest, if tls { 8883 } else { 1883 }),
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains(['/', '@', '?', ' ']) {
            return Err(BrokerUrlError::Host { url: url.into() });
        }
        Ok(BrokerAddr {
            host: host.to_string(),
            port,
            tls,
        })
    }
}

impl MqttConfig {
    /// The password from the variable `password_env` names (none without it).
    pub(crate) fn password(&self) -> Result<Option<String>, ConfigError> {
        let Some(var) = &self.password_env else {
            return Ok(None);
        };
        match std::env::var(var) {
            Ok(p) if !p.is_empty() => Ok(Some(p)),
            _ => Err(invalid(
                "mqtt.password_env",
                format!("the environment variable {var:?} is not set (or empty)"),
            )),
        }
    }

    /// Checks the section against the rest of the config, without connecting. An error
    /// names the field (`mqtt.subscription[0].topics`).
    pub(crate) fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        let addr =
            BrokerAddr::parse(&self.broker).map_err(|e| invalid("mqtt.broker", e.to_string()))?;
        let id_ok = !self.client_id.is_empty()
            && self.client_id.len() <= 128
            && !self.client_id.contains(['+', '#', '/', ' ']);
        if !id_ok {
            return Err(invalid(
                "mqtt.client_id",
                format!(
                    "{:?} is not a usable session name (1-128 characters, none of + # / or spaces)",
                    self.client_id
                ),
            ));
        }
        if self.password_env.is_some() && self.username.is_none() {
            return Err(invalid("mqtt.password_env", "needs mqtt.username"));
        }
        tls_files(
            "mqtt",
            &self.tls_ca_file,
            &self.tls_cert_file,
            &self.tls_key_file,
            (!addr.tls).then_some("is for TLS; the broker URL says mqtt://, use mqtts://"),
        )?;
        if !(Duration::from_secs(5)..=Duration::from_secs(3600)).contains(&self.keep_alive) {
            return Err(invalid("mqtt.keep_alive", "must be between 5s and 1h"));
        }
        if self.session_expiry < Duration::from_secs(60)
            || self.session_expiry.as_secs() >= u64::from(u32::MAX)
        {
            return Err(invalid(
                "mqtt.session_expiry",
                "must be at least 1m (a session that expires while dedupd restarts loses the messages queued for it)",
            ));
        }
        if self.max_packet_bytes < 1024 || self.max_packet_bytes > 256 << 20 {
            return Err(invalid(
                "mqtt.max_packet_bytes",
                "must be between 1024 and 268435456",
            ));
        }
        at_least_100ms(&[
            ("mqtt.connect_timeout", self.connect_timeout),
            ("mqtt.drain_timeout", self.drain_timeout),
            ("mqtt.reconnect_backoff_max", self.reconnect_backoff_max),
        ])?;
        if self.subscriptions.is_empty() {
            return Err(invalid(
                "mqtt.subscription",
                "must name at least one subscriber and its topics ([[mqtt.subscription]])",
            ));
        }
        for (i, s) in self.subscriptions.iter().enumerate() {
            let field = format!("mqtt.subscription[{i}]");
            s.validate(&field, self.protocol, config)?;
            for t in &s.topics {
                let twice = self.subscriptions[..i].iter().any(|o| o.topics.contains(t));
                if twice {
                    return Err(invalid(
                        format!("{field}.topics"),
                        format!("{t:?} is subscribed twice; one subscription per topic filter"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The filter a topic is matched against: a shared subscription's filter without its
/// `$share/<group>/` prefix.
pub(crate) fn match_filter(filter: &str) -> &str {
    filter
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'))
        .map_or(filter, |(_, f)| f)
}

impl SubscriptionConfig {
    fn validate(
        &self,
        field: &str,
        protocol: Protocol,
        config: &Config,
    ) -> Result<(), ConfigError> {
        if self.topics.is_empty() {
            return Err(invalid(
                format!("{field}.topics"),
                "must name at least one topic filter",
            ));
        }
        for t in &self.topics {
            let shared_ok = !t.starts_with("$share/")
                || t.split('/')
                    .nth(1)
                    .is_some_and(|g| !g.is_empty() && !g.contains(['+', '#']))
                    && t.splitn(3, '/').nth(2).is_some_and(|f| !f.is_empty());
            let f = match_filter(t);
            if !shared_ok || !rumqttc::valid_filter(f) || t.contains('\0') || t.len() > 65_535 {
                return Err(invalid(
                    format!("{field}.topics"),
                    format!("{t:?} is not a topic filter (levels separated by '/', '+' a whole level, '#' last; $share/<group>/<filter> for shared)"),
                ));
            }
            if f.starts_with('$') {
                return Err(invalid(
                    format!("{field}.topics"),
                    format!("{t:?}: topics starting with '$' are the broker's own ($SYS), not messages to process"),
                ));
            }
        }
        match self.qos {
            1 => {}
            2 => {
                return Err(invalid(
                    format!("{field}.qos"),
                    "QoS 2 is not supported: the client forgets the QoS 2 exchanges in progress when a connection drops and then fails on the broker's PUBREL; QoS 1 with the ledger already makes each message's effect happen once",
                ))
            }
            _ => {
                return Err(invalid(
                    format!("{field}.qos"),
                    "must be 1: QoS 0 has no acknowledgement to hold back until the outcome is durable",
                ))
            }
        }
        let settings = bound_subscriber(&format!("{field}.subscriber"), &self.subscriber, config)?;
        if settings.key == KeySource::Id && self.id_topic_level.is_none() {
            return Err(invalid(
                format!("{field}.id_topic_level"),
                format!(
                    "subscriber {:?} takes its idempotency key from the message `id`, which MQTT messages do not carry: set id_topic_level (the topic level holding the id), or key the subscriber by a header (an MQTT 5 user property), json_pointer, cloudevents or content_hash",
                    self.subscriber
                ),
            ));
        }
        if protocol == Protocol::V311 {
            if let KeySource::Header { name } = &settings.key {
                return Err(invalid(
                    format!("{field}.subscriber"),
                    format!(
                        "subscriber {:?} keys by the header {name:?}; MQTT 3.1.1 messages have no headers (user properties are MQTT 5: set mqtt.protocol = \"5\")",
                        self.subscriber
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::broker::testing::{assert_fields_named, refused};

    const BASE: &str = r#"
[[subscriber]]
name = "orders"
key = { source = "json_pointer", pointer = "/id" }

[mqtt]
broker = "mqtt://127.0.0.1:1883"
client_id = "dedupd-orders"

[[mqtt.subscription]]
subscriber = "orders"
topics = ["orders/#"]
"#;

    #[test]
    fn mqtt_section_parses_with_defaults() {
        let config = Config::parse(BASE).expect("config");
        let m = config.mqtt.expect("mqtt");
        assert_eq!(m.protocol, Protocol::V311);
        assert_eq!(m.receive_maximum.get(), 256);
        assert_eq!(m.subscriptions[0].qos, 1);
        assert_eq!(m.drain_timeout, Duration::from_secs(30));
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (
                BASE.replace("mqtt://127.0.0.1:1883", "tcp://x:1"),
                "mqtt.broker",
            ),
            (
                BASE.replace("mqtt://127.0.0.1:1883", "mqtt://x:port"),
                "mqtt.broker",
            ),
            (
                BASE.replace("\"dedupd-orders\"", "\"a/b\""),
                "mqtt.client_id",
            ),
            (
                BASE.replace("orders/#", "orders/#/x"),
                "mqtt.subscription[0].topics",
            ),
            (
                BASE.replace("orders/#", "$share//orders"),
                "mqtt.subscription[0].topics",
            ),
            (
                BASE.replace("orders/#", "$SYS/#"),
                "mqtt.subscription[0].topics",
            ),
            (
                BASE.replace("topics =", "qos = 2\ntopics ="),
                "mqtt.subscription[0].qos",
            ),
            (
                BASE.replace("topics =", "qos = 0\ntopics ="),
                "mqtt.subscription[0].qos",
            ),
            (
                BASE.replace("client_id =", "password_env = \"P\"\nclient_id ="),
                "mqtt.password_env",
            ),
            (
                BASE.replace(
                    "client_id =",
                    "tls_ca_file = \"/nonexistent.pem\"\nclient_id =",
                ),
                "mqtt.tls_ca_file",
            ),
            (
                BASE.replace("key = { source = \"json_pointer\", pointer = \"/id\" }", ""),
                "mqtt.subscription[0].id_topic_level",
            ),
            (
                BASE.replace(
                    "key = { source = \"json_pointer\", pointer = \"/id\" }",
                    "key = { source = \"header\", name = \"msg-id\" }",
                ),
                "mqtt.subscription[0].subscriber",
            ),
            (
                format!(
                    "{BASE}\n[[mqtt.subscription]]\nsubscriber = \"orders\"\ntopics = [\"orders/#\"]\n"
                ),
                "mqtt.subscription[1].topics",
            ),
        ];
        assert_fields_named(cases);
    }

    #[test]
    fn header_keys_are_accepted_with_mqtt_5_and_id_with_a_topic_level() {
        let v5 = BASE
            .replace(
                "key = { source = \"json_pointer\", pointer = \"/id\" }",
                "key = { source = \"header\", name = \"msg-id\" }",
            )
            .replace("client_id =", "protocol = \"5\"\nclient_id =");
        assert_eq!(
            Config::parse(&v5).expect("v5").mqtt.expect("m").protocol,
            Protocol::V5
        );
        let by_level = BASE
            .replace("key = { source = \"json_pointer\", pointer = \"/id\" }", "")
            .replace("topics =", "id_topic_level = 1\ntopics =");
        Config::parse(&by_level).expect("id from a topic level");
    }

    #[test]
    fn broker_urls_parse_with_default_ports() {
        let a = BrokerAddr::parse("mqtts://broker.local").expect("url");
        assert_eq!(
            (a.host.as_str(), a.port, a.tls),
            ("broker.local", 8883, true)
        );
        let b = BrokerAddr::parse("mqtt://[::1]:1884").expect("url");
        assert_eq!((b.host.as_str(), b.port, b.tls), ("::1", 1884, false));
        assert_eq!(
            BrokerAddr::parse("tcp://h").unwrap_err().to_string(),
            r#""tcp://h" is not a broker URL (mqtt://host:1883 or mqtts://host:8883)"#
        );
        assert_eq!(
            BrokerAddr::parse("mqtt://h:x").unwrap_err().to_string(),
            r#""mqtt://h:x": the port "x" is not a number"#
        );
        assert_eq!(
            BrokerAddr::parse("mqtt://u@h").unwrap_err().to_string(),
            r#""mqtt://u@h": no usable host name"#
        );
        assert_eq!(match_filter("$share/g/orders/+"), "orders/+");
        assert_eq!(match_filter("orders/+"), "orders/+");
    }

    #[test]
    fn a_section_without_subscriptions_is_refused() {
        let e = refused("[mqtt]\nbroker = \"mqtt://h\"\nclient_id = \"c\"\n");
        assert!(e.contains("mqtt.subscription"), "{e}");
    }
}
