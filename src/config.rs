//! Configuration: serde types that reject nonsense at load time.
//!
//! Every field has a default, so an empty file (or no file) is a valid configuration for the
//! embedded pipe mode. Durations take units (`"250ms"`, `"24h"`, `"7d"`).
//!
//! Where things are:
//!
//! - `config.rs`: the file as a whole ([`Config`]: load, parse, validate, the settings of
//!   a subscriber), its errors ([`ConfigError`]), and the small sections `[metrics]`
//!   ([`MetricsConfig`]) and `[pipe]` ([`PipeConfig`]);
//! - `ledger.rs`: `[ledger]`, the storage engine's settings and their bounds
//!   (`LedgerConfig`);
//! - `subscriber.rs`: `[defaults]` and `[[subscriber]]`: a subscriber's settings
//!   ([`SubscriberSettings`]), one as written ([`SubscriberConfig`]) and what a valid one
//!   is (`validate_subscriber_name` and the checks of every setting);
//! - `keys.rs`: where an idempotency key (`KeySource`) and a partition key
//!   ([`PartitionSource`]) come from, read through `SourceSpec`;
//! - `env.rs`: `${NAME}` in strings, from the environment;
//! - `broker.rs`: what the broker sections (`[kafka]`, `[nats]`, `[mqtt]`, `[rabbitmq]`,
//!   each in its source's `config.rs`) check alike: the bound subscriber, TLS and other
//!   files, the shortest timeouts;
//! - `fuzz.rs` (tests only): the fuzz target of config parsing.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Keys longer than this are rejected unless a subscriber says otherwise.
pub(crate) const DEFAULT_MAX_KEY_BYTES: usize = 1024;

/// Errors found while loading or validating a configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config: `{field}` {problem}")]
    Invalid { field: String, problem: String },
}

pub(crate) mod broker;
mod env;
#[cfg(test)]
mod fuzz;
mod keys;
mod ledger;
mod subscriber;

pub(crate) use keys::KeySource;

pub use keys::PartitionSource;

pub(crate) use ledger::LedgerConfig;
pub(crate) use subscriber::validate_subscriber_name;
pub use subscriber::{FingerprintSpec, SubscriberConfig, SubscriberSettings};

use subscriber::validate_settings;

pub(crate) fn invalid(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        problem: problem.into(),
    }
}

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where shard files live. The CLI flag `--data-dir` wins over this.
    pub data_dir: Option<PathBuf>,
    /// Storage engine settings.
    pub ledger: LedgerConfig,
    /// Settings for subscribers that are not listed in `subscriber`.
    pub defaults: SubscriberSettings,
    /// Accept messages for subscribers that are not listed, using `defaults`.
    pub allow_unknown_subscribers: bool,
    /// Subscriber used by pipe mode when an input line names none.
    pub default_subscriber: String,
    /// Explicitly configured subscribers.
    #[serde(rename = "subscriber")]
    pub subscribers: Vec<SubscriberConfig>,
    /// The admin and ingest HTTP server (`dedupd serve`; `dedupd run` starts it when set).
    #[serde(default)]
    pub http: Option<crate::admin::HttpConfig>,
    /// The Kafka source (`dedupd run` consumes it when present).
    #[serde(default)]
    pub kafka: Option<crate::source::kafka::KafkaConfig>,
    /// The NATS JetStream source (`dedupd run` consumes it when present).
    #[serde(default)]
    pub nats: Option<crate::source::nats::NatsConfig>,
    /// The MQTT source (`dedupd run` consumes it when present).
    #[serde(default)]
    pub mqtt: Option<crate::source::mqtt::MqttConfig>,
    /// The RabbitMQ source (`dedupd run` consumes it when present).
    #[serde(default)]
    pub rabbitmq: Option<crate::source::rabbitmq::RabbitMqConfig>,
    /// A listener for `/metrics`, `/healthz` and `/readyz` only (`dedupd run`), for
    /// deployments without the admin API or with it on another address.
    #[serde(default)]
    pub metrics: Option<MetricsConfig>,
    /// Limits of pipe mode (stdin lines in, outcome lines out).
    pub pipe: PipeConfig,
}

/// `[metrics]`: where the metrics-only listener binds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// For example `127.0.0.1:9464`. It serves subscriber names and counts, no payloads
    /// and no writes.
    pub bind: std::net::SocketAddr,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: None,
            ledger: LedgerConfig::default(),
            defaults: SubscriberSettings::default(),
            allow_unknown_subscribers: true,
            default_subscriber: "default".to_string(),
            subscribers: Vec::new(),
            http: None,
            kafka: None,
            nats: None,
            mqtt: None,
            rabbitmq: None,
            metrics: None,
            pipe: PipeConfig::default(),
        }
    }
}

/// Limits of pipe mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipeConfig {
    /// Longest input line in bytes (line ending excluded). A longer line is answered
    /// `rejected` without being kept in memory, and the stream goes on.
    pub(crate) max_line_bytes: NonZeroUsize,
    /// Lines read but not yet printed before reading pauses. Bounds memory when the head
    /// line waits (for a handler retry, say): stdin is not read further until it is printed.
    pub(crate) window: NonZeroUsize,
    /// Bytes of lines read but not yet printed before reading pauses (one line more may
    /// be read): with `window` alone, memory was bounded only by `window` x
    /// `max_line_bytes`, 64 GiB at the defaults.
    pub(crate) max_bytes_in_flight: NonZeroUsize,
}

impl Default for PipeConfig {
    fn default() -> Self {
        PipeConfig {
            max_line_bytes: nz(1 << 20),
            window: nz(65_536),
            max_bytes_in_flight: nz(256 << 20),
        }
    }
}

fn nz(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN)
}

impl Config {
    /// Reads and validates a TOML file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = Config::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })?;
        // Handler paths are relative to the config file, like includes in most tools.
        let base = path.parent().unwrap_or(Path::new("."));
        let rebase = |p: &mut Option<PathBuf>| {
            if let Some(h) = p.as_mut().filter(|h| h.is_relative()) {
                *h = base.join(&*h);
            }
        };
        rebase(&mut config.defaults.handler);
        for s in &mut config.subscribers {
            rebase(&mut s.handler);
        }
        Ok(config)
    }

    /// Parses and validates TOML text, with `${NAME}` in strings replaced by environment
    /// variables (see `config/env.rs`).
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse_with_env(text, &|name| std::env::var(name).ok())
    }

    fn parse_with_env(
        text: &str,
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let parse_error = |e: &dyn std::fmt::Display| ConfigError::Parse {
            path: PathBuf::from("<text>"),
            message: e.to_string(),
        };
        // Variables are expanded before the settings are read: a duration or an address
        // written as `"${TTL}"` is only a duration once expanded. Without any, the text is
        // read as it is, so errors point at a line and column.
        let config: Config = if text.contains("${") {
            let mut value: toml::Value = toml::from_str(text).map_err(|e| parse_error(&e))?;
            env::expand(&mut value, "", lookup)?;
            value.try_into().map_err(|e| parse_error(&e))?
        } else {
            toml::from_str(text).map_err(|e| parse_error(&e))?
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks cross-field rules that types alone cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_settings("defaults", &self.defaults)?;
        validate_subscriber_name("default_subscriber", &self.default_subscriber)?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, s) in self.subscribers.iter().enumerate() {
            validate_subscriber_name(&format!("subscriber[{i}].name"), &s.name)?;
            if !seen.insert(s.name.as_str()) {
                return Err(invalid(
                    format!("subscriber[{i}].name"),
                    format!("repeats subscriber {:?}", s.name),
                ));
            }
            validate_settings(&format!("subscriber[{i}]"), &s.resolve(&self.defaults))?;
        }
        if let Some(shards) = self.ledger.shards {
            if shards.get() > 256 {
                return Err(invalid("ledger.shards", "must be at most 256"));
            }
        }
        self.ledger.validate_sizes()?;
        if self.ledger.max_linger > Duration::from_secs(1) {
            return Err(invalid(
                "ledger.max_linger",
                "must be at most 1s (it adds directly to ack latency)",
            ));
        }
        if self.ledger.generation_max_age < Duration::from_secs(1) {
            return Err(invalid("ledger.generation_max_age", "must be at least 1s"));
        }
        if self.ledger.record_retention < Duration::from_secs(1) {
            return Err(invalid("ledger.record_retention", "must be at least 1s"));
        }
        if self.pipe.max_line_bytes.get() > 1 << 30 {
            return Err(invalid("pipe.max_line_bytes", "must be at most 1 GiB"));
        }
        if let Some(kafka) = &self.kafka {
            kafka.validate(self)?;
        }
        // One broker source per instance: each owns the stop, the drain and `/readyz`.
        let brokers: Vec<&str> = [
            ("kafka", self.kafka.is_some()),
            ("nats", self.nats.is_some()),
            ("mqtt", self.mqtt.is_some()),
            ("rabbitmq", self.rabbitmq.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, present)| present.then_some(name))
        .collect();
        if let [first, second, ..] = brokers[..] {
            return Err(invalid(
                second,
                format!(
                    "cannot run beside [{first}] in one instance yet; run one dedupd per broker"
                ),
            ));
        }
        if let Some(nats) = &self.nats {
            nats.validate(self)?;
        }
        if let Some(mqtt) = &self.mqtt {
            mqtt.validate(self)?;
        }
        if let Some(rabbitmq) = &self.rabbitmq {
            rabbitmq.validate(self)?;
        }
        Ok(())
    }

    /// The settings for a subscriber, or `None` if it is unknown and unknown ones are refused.
    pub(crate) fn settings_for(&self, name: &str) -> Option<SubscriberSettings> {
        match self.subscribers.iter().find(|s| s.name == name) {
            Some(s) => Some(s.resolve(&self.defaults)),
            None if self.allow_unknown_subscribers => Some(self.defaults.clone()),
            None => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `${NAME}` in strings reads the environment (here a fake one); an unset name is an
    /// error that names the field.
    #[test]
    fn environment_variables_fill_config_strings() {
        let text = "[http]\nbind = \"127.0.0.1:0\"\ntoken = \"${DEDUPD_TOKEN}\"\n";
        let c = Config::parse_with_env(text, &|n| (n == "DEDUPD_TOKEN").then(|| "t0ken".into()))
            .unwrap();
        assert_eq!(c.http.unwrap().token.as_deref(), Some("t0ken"));
        let e = Config::parse_with_env(text, &|_| None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("http.token") && e.contains("DEDUPD_TOKEN"),
            "{e}"
        );
    }

    /// Settings that are strings in TOML but not text to dedupd (durations, addresses)
    /// take variables too: they are expanded before the file is read into settings.
    #[test]
    fn environment_variables_fill_durations_and_addresses() {
        let text = "[defaults]\nttl = \"${TTL}\"\n[http]\nbind = \"${BIND:-127.0.0.1:8080}\"\n";
        let env = |n: &str| (n == "TTL").then(|| "7d".to_string());
        let c = Config::parse_with_env(text, &env).unwrap();
        assert_eq!(c.defaults.ttl, Duration::from_secs(7 * 86_400));
        assert_eq!(c.http.unwrap().bind, "127.0.0.1:8080".parse().unwrap());
    }

    /// The sample shipped in the repository must stay valid.
    #[test]
    fn sample_config_parses() {
        let text = include_str!("../dedupd.example.toml");
        let config = Config::parse(text).expect("sample config");
        assert_eq!(config.subscribers.len(), 2);
        let billing = config.settings_for("billing").expect("billing");
        assert_eq!(
            billing.key,
            KeySource::JsonPointer {
                pointer: "/order_id".into(),
                pointers: vec![]
            }
        );
        assert!(billing.sliding_ttl);
        assert_eq!(
            billing.max_key_bytes, DEFAULT_MAX_KEY_BYTES,
            "inherited from defaults"
        );
        // The sample lists the defaults.
        let d = SubscriberSettings::default();
        assert_eq!(
            (billing.handler_max_writes, billing.handler_max_write_mib),
            (d.handler_max_writes, d.handler_max_write_mib)
        );
        assert_eq!(billing.max_backoff, d.max_backoff);
        assert_eq!(
            (
                billing.handler_breaker_failures,
                billing.handler_breaker_cooldown
            ),
            (d.handler_breaker_failures, d.handler_breaker_cooldown)
        );
        assert_eq!(config.pipe, PipeConfig::default());
    }

    #[test]
    fn empty_config_is_valid() {
        let config = Config::parse("").expect("empty config");
        assert_eq!(config.default_subscriber, "default");
        assert!(config.settings_for("anything").is_some());
    }

    #[test]
    fn unknown_field_is_refused() {
        let err = Config::parse("[ledger]\nmax_bach = 3\n").unwrap_err();
        assert!(err.to_string().contains("max_bach"), "{err}");
    }

    #[test]
    fn unknown_subscriber_field_is_refused() {
        let err = Config::parse("[[subscriber]]\nname = \"a\"\nttll = \"1h\"\n").unwrap_err();
        assert!(err.to_string().contains("ttll"), "{err}");
    }

    #[test]
    fn handler_write_bounds_out_of_range_are_refused() {
        let err = Config::parse("[defaults]\nhandler_max_writes = 0\n").unwrap_err();
        assert!(
            err.to_string().contains("defaults.handler_max_writes"),
            "{err}"
        );
        let text = "[[subscriber]]\nname = \"a\"\nhandler_max_write_mib = 1025\n";
        let err = Config::parse(text).unwrap_err();
        assert!(
            err.to_string()
                .contains("subscriber[0].handler_max_write_mib"),
            "{err}"
        );
        let text = "[[subscriber]]\nname = \"a\"\nhandler_max_writes = 1000000\nhandler_max_write_mib = 1024\n";
        let a = Config::parse(text).unwrap().settings_for("a").unwrap();
        assert_eq!(
            (a.handler_max_writes, a.handler_max_write_mib),
            (1_000_000, 1024)
        );
    }

    #[test]
    fn max_backoff_defaults_to_one_minute_and_can_be_set() {
        let d = Config::parse("").unwrap().settings_for("a").unwrap();
        assert_eq!(d.max_backoff, Duration::from_secs(60));
        let text = "[[subscriber]]\nname = \"a\"\nretry_backoff = \"2m\"\nmax_backoff = \"5m\"\n";
        let a = Config::parse(text).unwrap().settings_for("a").unwrap();
        assert_eq!(a.max_backoff, Duration::from_secs(300));
    }

    #[test]
    fn max_backoff_below_retry_backoff_or_over_an_hour_is_refused() {
        let text = "[[subscriber]]\nname = \"a\"\nretry_backoff = \"2s\"\nmax_backoff = \"1s\"\n";
        let err = Config::parse(text).unwrap_err();
        assert!(
            err.to_string().contains("subscriber[0].max_backoff"),
            "{err}"
        );
        let err = Config::parse("[defaults]\nmax_backoff = \"2h\"\n").unwrap_err();
        assert!(err.to_string().contains("defaults.max_backoff"), "{err}");
    }

    #[test]
    fn zero_batch_is_refused() {
        assert!(Config::parse("[ledger]\nmax_batch = 0\n").is_err());
    }

    /// Each bounded ledger count with its lowest and highest allowed value.
    const LEDGER_BOUNDS: &[(&str, usize, usize)] = &[
        ("max_batch", 1, 1 << 20),
        ("generation_max_claims", 16, 1 << 24),
        ("merge_max_claims", 16, 1 << 30),
        ("merge_trigger_generations", 1, 1024),
        ("state_buffer_entries", 16, 1 << 22),
        ("cache_mib", 1, 1 << 16),
        ("max_implicit_subscribers", 0, 1 << 16),
    ];

    #[test]
    fn ledger_size_bounds_obeyed() {
        for &(field, min, max) in LEDGER_BOUNDS {
            for value in [min, max] {
                let text = format!("[ledger]\n{field} = {value}\n");
                if let Err(e) = Config::parse(&text) {
                    panic!("{field} = {value} must be accepted: {e}");
                }
            }
        }
        // The values tests and benches use stay valid.
        let small = "[ledger]\ngeneration_max_claims = 40\nmerge_max_claims = 200\nmerge_trigger_generations = 2\nstate_buffer_entries = 64\nmax_batch = 1024\n";
        assert!(Config::parse(small).is_ok());
    }

    #[test]
    fn ledger_size_bounds_violated() {
        for &(field, min, max) in LEDGER_BOUNDS {
            let mut values = vec![max + 1, usize::MAX >> 1];
            if min > 1 {
                values.push(min - 1);
            }
            for value in values {
                let text = format!("[ledger]\n{field} = {value}\n");
                let err = Config::parse(&text).expect_err(field).to_string();
                assert!(
                    err.contains(&format!("ledger.{field}"))
                        && err.contains(&format!("between {min} and {max}")),
                    "{field} = {value}: {err}"
                );
            }
        }
    }

    /// `pointers` makes a composite key; `pointer` and `pointers` together, neither, a
    /// part that is not a pointer or one listed twice are refused naming the field.
    #[test]
    fn composite_json_pointer_keys_parse_and_bad_ones_are_refused() {
        let sub = |key: &str| format!("[[subscriber]]\nname = \"a\"\nkey = {key}\n");
        let ok = Config::parse(&sub(
            r#"{ source = "json_pointer", pointers = ["/tenant", "/order_id"] }"#,
        ))
        .unwrap();
        assert_eq!(
            ok.settings_for("a").unwrap().key,
            KeySource::JsonPointer {
                pointer: String::new(),
                pointers: vec!["/tenant".into(), "/order_id".into()],
            }
        );
        for (key, field) in [
            (
                r#"{ source = "json_pointer", pointer = "/a", pointers = ["/b"] }"#,
                "`subscriber[0].key` json_pointer takes",
            ),
            (
                r#"{ source = "json_pointer" }"#,
                "`subscriber[0].key` json_pointer takes",
            ),
            (
                r#"{ source = "json_pointer", pointers = ["/a", "b"] }"#,
                "subscriber[0].key.pointers[1]",
            ),
            (
                r#"{ source = "json_pointer", pointers = ["/a", "/a"] }"#,
                "subscriber[0].key.pointers[1]",
            ),
        ] {
            let err = Config::parse(&sub(key)).unwrap_err().to_string();
            assert!(err.contains(field), "{key}: {err}");
        }
    }

    /// A field the named source does not take is refused, naming it: serde alone drops
    /// unknown fields of sources without fields (`id`, `cloudevents`...).
    #[test]
    fn key_source_fields_the_source_does_not_take_are_refused() {
        for (section, value, needle) in [
            ("key", r#"{ source = "id", pointer = "/x" }"#, "`pointer`"),
            ("key", r#"{ source = "cloudevents", name = "x" }"#, "`name`"),
            (
                "key",
                r#"{ source = "content_hash", pointers = ["/a"] }"#,
                "`pointers`",
            ),
            (
                "key",
                r#"{ source = "header", pointer = "/x", name = "x" }"#,
                "`pointer`",
            ),
            ("key", r#"{ source = "header" }"#, "needs `name`"),
            (
                "key",
                r#"{ source = "json_pointer", pointer = "/x", nmae = "y" }"#,
                "nmae",
            ),
            ("key", r#"{ source = "idd" }"#, "unknown key source"),
            (
                "partition_key",
                r#"{ source = "envelope_key", name = "k" }"#,
                "`name`",
            ),
            (
                "partition_key",
                r#"{ source = "json_pointer", pointers = ["/a"] }"#,
                "`pointers`",
            ),
        ] {
            let text = format!("[[subscriber]]\nname = \"a\"\n{section} = {value}\n");
            let err = Config::parse(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{value}: {err}");
        }
        let ok = "[[subscriber]]\nname = \"a\"\nkey = { source = \"id\" }\npartition_key = { source = \"header\", name = \"x\" }\n";
        assert!(Config::parse(ok).is_ok());
    }

    #[test]
    fn partition_key_pointer_without_slash_is_refused() {
        let text = "[[subscriber]]\nname = \"a\"\npartition_key = { source = \"json_pointer\", pointer = \"order_id\" }\n";
        let err = Config::parse(text).unwrap_err().to_string();
        assert!(err.contains("subscriber[0].partition_key.pointer"), "{err}");
        let text = "[defaults]\npartition_key = { source = \"header\", name = \"\" }\n";
        let err = Config::parse(text).unwrap_err().to_string();
        assert!(err.contains("defaults.partition_key.name"), "{err}");
        let ok =
            "[defaults]\npartition_key = { source = \"json_pointer\", pointer = \"/order_id\" }\n";
        assert!(Config::parse(ok).is_ok());
    }

    #[test]
    fn bad_subscriber_name_is_refused() {
        let err = Config::parse("[[subscriber]]\nname = \"a/b\"\n").unwrap_err();
        assert!(err.to_string().contains("subscriber[0].name"), "{err}");
    }

    #[test]
    fn short_ttl_is_refused() {
        let err = Config::parse("[defaults]\nttl = \"10ms\"\n").unwrap_err();
        assert!(err.to_string().contains("defaults.ttl"), "{err}");
    }

    #[test]
    fn unknown_subscriber_refused_when_disallowed() {
        let config = Config::parse("allow_unknown_subscribers = false\n").expect("config");
        assert!(config.settings_for("nobody").is_none());
    }
}
