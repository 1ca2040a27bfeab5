//! The `[nats]` section of the config file, and its offline checks.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::broker::{at_least_100ms, bound_subscriber, readable_file, tls_files};
use crate::config::{invalid, Config, ConfigError};

/// The NATS JetStream source: durable pull consumers feeding subscribers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`, or `host:port`); the client
    /// reconnects to any of them.
    pub(crate) servers: Vec<String>,
    /// Client name shown by the server (`nats server report connections`).
    #[serde(default = "default_name")]
    pub(crate) name: String,
    /// A `.creds` file (user JWT and NKey seed) for decentralised auth.
    #[serde(default)]
    pub(crate) credentials_file: Option<PathBuf>,
    /// A token (`--auth` of nats-server). Not with `user` or `credentials_file`.
    #[serde(default)]
    pub(crate) token: Option<String>,
    /// User name; `password` goes with it.
    #[serde(default)]
    pub(crate) user: Option<String>,
    #[serde(default)]
    pub(crate) password: Option<String>,
    /// Connect with TLS even when the URL says `nats://`.
    #[serde(default)]
    pub(crate) require_tls: bool,
    /// PEM file of the CA that signed the server's certificate (else the system's roots).
    #[serde(default)]
    pub(crate) tls_ca_file: Option<PathBuf>,
    /// PEM client certificate and key (mutual TLS); both or neither.
    #[serde(default)]
    pub(crate) tls_cert_file: Option<PathBuf>,
    #[serde(default)]
    pub(crate) tls_key_file: Option<PathBuf>,
    /// Longest wait for the first connection at start.
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub(crate) connect_timeout: Duration,
    /// Longest wait for in-flight work at shutdown; what is not durable by then is `Nak`ed
    /// and redelivered.
    #[serde(default = "default_drain_timeout", with = "humantime_serde")]
    pub(crate) drain_timeout: Duration,
    /// Streams and durable consumers -> subscribers; one pull consumer per binding.
    #[serde(rename = "binding", default)]
    pub(crate) bindings: Vec<BindingConfig>,
}

/// One durable pull consumer of one stream, feeding one subscriber.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BindingConfig {
    /// The subscriber (its key source, partition key and handler apply). Its `id` key
    /// source reads the `Nats-Msg-Id` header; a `header`, `json_pointer`, `cloudevents` or
    /// `content_hash` source reads the message as for any other source.
    pub(crate) subscriber: String,
    /// The JetStream stream.
    pub(crate) stream: String,
    /// The durable consumer's name; several dedupd instances naming the same one share
    /// its messages.
    pub(crate) durable: String,
    /// Create the durable consumer when it does not exist (with the settings below). A
    /// consumer that exists is used as it is.
    #[serde(default = "yes")]
    pub(crate) create: bool,
    /// Subjects of the stream the consumer takes (created consumers only; empty: all).
    #[serde(default)]
    pub(crate) filter_subject: Option<String>,
    /// `MaxAckPending` of a created consumer, and the messages this instance holds
    /// unacknowledged: the in-flight window.
    #[serde(default = "default_max_ack_pending")]
    pub(crate) max_ack_pending: NonZeroUsize,
    /// Messages asked for per pull request (at most `max_ack_pending`).
    #[serde(default = "default_batch")]
    pub(crate) batch: NonZeroUsize,
    /// `AckWait` of a created consumer: a message not acknowledged within it is delivered
    /// again (to this or another instance); the redelivery is a `duplicate` once durable.
    #[serde(default = "default_ack_wait", with = "humantime_serde")]
    pub(crate) ack_wait: Duration,
    /// The delay of a `Nak`: how long a message given back (not durable at shutdown)
    /// waits before it is delivered again.
    #[serde(default = "default_nak_delay", with = "humantime_serde")]
    pub(crate) nak_delay: Duration,
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
fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_ack_pending() -> NonZeroUsize {
    NonZeroUsize::new(4096).unwrap_or(NonZeroUsize::MIN)
}
fn default_batch() -> NonZeroUsize {
    NonZeroUsize::new(256).unwrap_or(NonZeroUsize::MIN)
}
fn default_ack_wait() -> Duration {
    Duration::from_secs(30)
}
fn default_nak_delay() -> Duration {
    Duration::from_secs(1)
}

impl NatsConfig {
    /// A config with defaults for everything but the servers.
    pub(crate) fn new(servers: Vec<String>) -> NatsConfig {
        NatsConfig {
            servers,
            name: default_name(),
            credentials_file: None,
            token: None,
            user: None,
            password: None,
            require_tls: false,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            connect_timeout: default_connect_timeout(),
            drain_timeout: default_drain_timeout(),
            bindings: Vec::new(),
        }
    }

    /// Checks the section against the rest of the config, without connecting. An error
    /// names the field (`nats.binding[0].stream`).
    pub(crate) fn validate(&self, config: &Config) -> Result<(), ConfigError> {
        if self.servers.is_empty() {
            return Err(invalid("nats.servers", "must name at least one server URL"));
        }
        for s in &self.servers {
            if let Err(e) = s.parse::<async_nats::ServerAddr>() {
                return Err(invalid(
                    "nats.servers",
                    format!("{s:?} is not a server URL (nats://host:port): {e}"),
                ));
            }
        }
        let auths = [
            self.credentials_file.is_some(),
            self.token.is_some(),
            self.user.is_some(),
        ];
        if auths.iter().filter(|a| **a).count() > 1 {
            return Err(invalid(
                "nats.token",
                "give one of credentials_file, token, or user and password",
            ));
        }
        if self.password.is_some() != self.user.is_some() {
            return Err(invalid("nats.password", "user and password go together"));
        }
        readable_file("nats.credentials_file", &self.credentials_file)?;
        tls_files(
            "nats",
            &self.tls_ca_file,
            &self.tls_cert_file,
            &self.tls_key_file,
            None,
        )?;
        at_least_100ms(&[
            ("nats.drain_timeout", self.drain_timeout),
            ("nats.connect_timeout", self.connect_timeout),
        ])?;
        if self.bindings.is_empty() {
            return Err(invalid(
                "nats.binding",
                "must name at least one stream and durable consumer ([[nats.binding]])",
            ));
        }
        for (i, b) in self.bindings.iter().enumerate() {
            b.validate(&format!("nats.binding[{i}]"), config)?;
            let same = self.bindings[..i]
                .iter()
                .any(|o| o.stream == b.stream && o.durable == b.durable);
            if same {
                return Err(invalid(
                    format!("nats.binding[{i}].durable"),
                    format!(
                        "{:?} of stream {:?} is bound twice; one binding per durable consumer",
                        b.durable, b.stream
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl BindingConfig {
    fn validate(&self, field: &str, config: &Config) -> Result<(), ConfigError> {
        validate_name(&format!("{field}.stream"), &self.stream)?;
        validate_name(&format!("{field}.durable"), &self.durable)?;
        if let Some(f) = &self.filter_subject {
            if f.is_empty() || f.split('.').any(str::is_empty) || f.contains(char::is_whitespace) {
                return Err(invalid(
                    format!("{field}.filter_subject"),
                    format!("{f:?} is not a subject (tokens separated by '.', no spaces)"),
                ));
            }
        }
        if self.batch > self.max_ack_pending {
            return Err(invalid(
                format!("{field}.batch"),
                "must be at most max_ack_pending (the in-flight window)",
            ));
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err(invalid(format!("{field}.ack_wait"), "must be at least 1s"));
        }
        if self.nak_delay > Duration::from_secs(3600) {
            return Err(invalid(format!("{field}.nak_delay"), "must be at most 1h"));
        }
        bound_subscriber(&format!("{field}.subscriber"), &self.subscriber, config)?;
        Ok(())
    }
}

/// Stream and consumer names: no whitespace, `.`, `*`, `>`, path separators (they are
/// tokens of JetStream API subjects and file names on the server).
fn validate_name(field: &str, name: &str) -> Result<(), ConfigError> {
    let bad = |c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\');
    if name.is_empty() || name.len() > 255 || name.contains(bad) {
        return Err(invalid(
            field,
            format!(
                "{name:?} is not a JetStream name (1-255 characters, none of . * > / \\ or spaces)"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::broker::testing::{assert_fields_named, refused};

    const BASE: &str = r#"
[nats]
servers = ["nats://127.0.0.1:4222"]

[[nats.binding]]
subscriber = "orders"
stream = "ORDERS"
durable = "dedupd-orders"
"#;

    #[test]
    fn nats_section_parses_with_defaults() {
        let config = Config::parse(BASE).expect("config");
        let n = config.nats.expect("nats");
        let b = &n.bindings[0];
        assert!(b.create);
        assert_eq!(b.max_ack_pending.get(), 4096);
        assert_eq!(b.batch.get(), 256);
        assert_eq!(b.ack_wait, Duration::from_secs(30));
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (BASE.replace("ORDERS", "OR.DERS"), "nats.binding[0].stream"),
            (BASE.replace("dedupd-orders", "a b"), "nats.binding[0].durable"),
            (BASE.replace("nats://127.0.0.1:4222", "http://x:1"), "nats.servers"),
            (
                BASE.replace("durable = \"dedupd-orders\"", "durable = \"d\"\nbatch = 10\nmax_ack_pending = 5"),
                "nats.binding[0].batch",
            ),
            (
                BASE.replace("servers =", "token = \"t\"\nuser = \"u\"\npassword = \"p\"\nservers ="),
                "nats.token",
            ),
            (
                BASE.replace("servers =", "tls_cert_file = \"/nonexistent.pem\"\nservers ="),
                "nats.tls_key_file",
            ),
            (
                format!("{BASE}\n[[nats.binding]]\nsubscriber = \"x\"\nstream = \"ORDERS\"\ndurable = \"dedupd-orders\"\n"),
                "nats.binding[1].durable",
            ),
        ];
        assert_fields_named(cases);
    }

    #[test]
    fn a_section_without_bindings_is_refused() {
        let e = refused("[nats]\nservers = [\"nats://127.0.0.1:4222\"]\n");
        assert!(e.contains("nats.binding"), "{e}");
    }
}
