//! The `[http]` section: where the admin and ingest server listens and what it allows.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// Settings of the admin and ingest HTTP server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Address to listen on. Loopback by default; any other address needs a token.
    pub bind: SocketAddr,
    /// Bearer token required by mutating routes and payload reads. Prefer `token_env`.
    pub(crate) token: Option<String>,
    /// Name of an environment variable holding the bearer token.
    pub(crate) token_env: Option<String>,
    /// Largest request body (ingest payloads, config updates), in bytes.
    pub(crate) max_body_bytes: usize,
    /// Largest handler component accepted by an upload, in bytes.
    pub(crate) max_handler_bytes: usize,
    /// Requests served at once; further ones wait in a bounded queue for a slot.
    pub(crate) max_concurrency: usize,
    /// Requests that may wait for a slot; past it a request is answered 503 with
    /// `Retry-After` at once (0: never wait).
    pub(crate) max_queued: usize,
    /// Longest wait in that queue before a 503 with `Retry-After`.
    #[serde(with = "humantime_serde")]
    pub(crate) queue_timeout: Duration,
    /// Longest time from a request's headers to its response (body upload included);
    /// past it the answer is 503 `timeout`. Work already handed to the engine finishes.
    #[serde(with = "humantime_serde")]
    pub(crate) request_timeout: Duration,
    /// Longest time a connection may take to send a request's headers (and to stay idle
    /// between keep-alive requests) before it is closed.
    #[serde(with = "humantime_serde")]
    pub(crate) header_timeout: Duration,
    /// Host names (without port) accepted in `Host` and `Origin`, besides the bind
    /// address and, on a loopback bind, `localhost`, `127.0.0.1` and `[::1]`. Needed when
    /// the API is reached by a DNS name (a reverse proxy, say).
    pub(crate) allowed_hosts: Vec<String>,
    /// Where `POST /v1/maintenance/backup` creates backups (default: `DATA_DIR/backups`).
    /// A request names only a directory *inside* it.
    pub(crate) backup_dir: Option<PathBuf>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 8080)),
            token: None,
            token_env: None,
            max_body_bytes: 1 << 20,
            max_handler_bytes: 16 << 20,
            max_concurrency: 1024,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            header_timeout: Duration::from_secs(10),
            allowed_hosts: Vec::new(),
            backup_dir: None,
        }
    }
}

fn invalid(field: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: format!("http.{field}"),
        problem: problem.into(),
    }
}

impl HttpConfig {
    /// Checks the limits and resolves the token (from `token` or the variable `token_env`
    /// names). Refuses a non-loopback `bind` without a token: the API can forget claims and
    /// replace handlers, so it is never open to the network.
    pub(crate) fn resolve_token(&self) -> Result<Option<String>, ConfigError> {
        self.check_limits()?;
        self.check_allowed_hosts()?;
        let token = self.token()?;
        if token.is_none() && !self.bind.ip().is_loopback() {
            return Err(invalid(
                "bind",
                format!(
                    "is {}, not a loopback address, and no token is configured: set http.token_env (or bind 127.0.0.1)",
                    self.bind
                ),
            ));
        }
        Ok(token)
    }

    /// Size, concurrency and time limits within their ranges.
    fn check_limits(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 || self.max_body_bytes > 256 << 20 {
            return Err(invalid("max_body_bytes", "must be between 1 and 268435456"));
        }
        if self.max_handler_bytes == 0 || self.max_handler_bytes > 256 << 20 {
            return Err(invalid(
                "max_handler_bytes",
                "must be between 1 and 268435456",
            ));
        }
        if self.max_concurrency == 0 || self.max_concurrency > 1 << 20 {
            return Err(invalid("max_concurrency", "must be between 1 and 1048576"));
        }
        if self.max_queued > 1 << 20 {
            return Err(invalid("max_queued", "must be at most 1048576"));
        }
        for (field, value) in [
            ("queue_timeout", self.queue_timeout),
            ("request_timeout", self.request_timeout),
            ("header_timeout", self.header_timeout),
        ] {
            if value < Duration::from_millis(1) || value > Duration::from_secs(3600) {
                return Err(invalid(field, "must be between 1ms and 1h"));
            }
        }
        Ok(())
    }

    /// Every `allowed_hosts` entry is a bare host name or IP address.
    fn check_allowed_hosts(&self) -> Result<(), ConfigError> {
        for host in &self.allowed_hosts {
            let bare = host.trim_start_matches('[').trim_end_matches(']');
            let name = !host.is_empty()
                && host.len() <= 253
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_');
            let ok = name || bare.parse::<std::net::IpAddr>().is_ok();
            if !ok {
                return Err(invalid(
                    "allowed_hosts",
                    format!(
                        "{host:?} is not a host name (no scheme, port or path: `api.example.com`)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The token from `token` or the variable `token_env` names (not both), if usable.
    fn token(&self) -> Result<Option<String>, ConfigError> {
        let token = match (&self.token, &self.token_env) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "token",
                    "set either `token` or `token_env`, not both",
                ))
            }
            (Some(t), None) => Some(t.clone()),
            (None, Some(var)) => match std::env::var(var) {
                Ok(t) => Some(t),
                Err(_) => {
                    return Err(invalid(
                        "token_env",
                        format!("names ${var}, which is not set (or not UTF-8)"),
                    ))
                }
            },
            (None, None) => None,
        };
        if let Some(t) = &token {
            if t.len() < 16 {
                return Err(invalid("token", "must be at least 16 characters"));
            }
            if !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid("token", "must be printable ASCII without spaces"));
            }
        }
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]
    use super::*;

    /// The sample configuration documents this section with its defaults.
    #[test]
    fn sample_config_has_the_http_defaults() {
        let config =
            crate::config::Config::parse(include_str!("../../dedupd.example.toml")).unwrap();
        assert_eq!(config.http, Some(HttpConfig::default()));
    }

    #[test]
    fn unknown_http_field_is_refused() {
        let err = crate::config::Config::parse("[http]\nbnd = \"127.0.0.1:1\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bnd"), "{err}");
    }

    #[test]
    fn default_is_loopback_without_token() {
        let c = HttpConfig::default();
        assert!(c.bind.ip().is_loopback());
        assert_eq!(c.resolve_token().unwrap(), None);
    }

    #[test]
    fn public_bind_without_token_is_refused() {
        let c = HttpConfig {
            bind: "0.0.0.0:8080".parse().unwrap(),
            ..HttpConfig::default()
        };
        let err = c.resolve_token().unwrap_err().to_string();
        assert!(err.contains("http.bind"), "{err}");
    }

    #[test]
    fn public_bind_with_token_is_accepted() {
        let c = HttpConfig {
            bind: "0.0.0.0:8080".parse().unwrap(),
            token: Some("0123456789abcdef-token".into()),
            ..HttpConfig::default()
        };
        assert!(c.resolve_token().unwrap().is_some());
    }

    #[test]
    fn short_token_is_refused() {
        let c = HttpConfig {
            token: Some("short".into()),
            ..HttpConfig::default()
        };
        let err = c.resolve_token().unwrap_err().to_string();
        assert!(err.contains("http.token"), "{err}");
    }

    #[test]
    fn allowed_host_with_a_port_or_scheme_is_refused() {
        for bad in ["dedupd.internal:8080", "http://dedupd.internal", ""] {
            let c = HttpConfig {
                allowed_hosts: vec![bad.into()],
                ..HttpConfig::default()
            };
            let err = c.resolve_token().unwrap_err().to_string();
            assert!(err.contains("http.allowed_hosts"), "{bad}: {err}");
        }
        let c = HttpConfig {
            allowed_hosts: vec!["dedupd.internal".into(), "[fd00::1]".into()],
            ..HttpConfig::default()
        };
        assert!(c.resolve_token().is_ok());
    }

    #[test]
    fn zero_timeouts_are_refused() {
        let c = crate::config::Config::parse(
            "[http]
request_timeout = \"0s\"\n",
        )
        .unwrap();
        let err = c.http.unwrap().resolve_token().unwrap_err().to_string();
        assert!(err.contains("http.request_timeout"), "{err}");
    }

    #[test]
    fn missing_token_env_is_refused() {
        let c = HttpConfig {
            token_env: Some("DEDUPD_TEST_SURELY_UNSET_VARIABLE".into()),
            ..HttpConfig::default()
        };
        let err = c.resolve_token().unwrap_err().to_string();
        assert!(err.contains("http.token_env"), "{err}");
    }
}
