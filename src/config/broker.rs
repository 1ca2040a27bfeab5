//! What the broker sections (`[kafka]`, `[nats]`, `[mqtt]`, `[rabbitmq]`) check alike: the
//! subscriber a binding feeds, files that must be readable (TLS, credentials) and the
//! shortest timeouts. Each error names the field as the section spells it
//! (`nats.binding[0].subscriber`).

use std::path::PathBuf;
use std::time::Duration;

use super::{invalid, validate_subscriber_name, Config, ConfigError, SubscriberSettings};

/// The settings of the subscriber `name` that `field` binds a queue, stream or topic to:
/// a valid name, configured (or allowed by `allow_unknown_subscribers`).
pub(crate) fn bound_subscriber(
    field: &str,
    name: &str,
    config: &Config,
) -> Result<SubscriberSettings, ConfigError> {
    validate_subscriber_name(field, name)?;
    config.settings_for(name).ok_or_else(|| {
        invalid(
            field,
            format!(
                "names {name:?}, which is not configured and `allow_unknown_subscribers` is false"
            ),
        )
    })
}

/// A file a section names (`field`), when given, is there and a regular file.
pub(crate) fn readable_file(field: &str, path: &Option<PathBuf>) -> Result<(), ConfigError> {
    match path {
        Some(p) if !p.is_file() => Err(invalid(
            field,
            format!("{} is not a readable file", p.display()),
        )),
        _ => Ok(()),
    }
}

/// The TLS files of a section (`{section}.tls_ca_file`, `tls_cert_file`, `tls_key_file`):
/// the client certificate and key go together, and each file given is readable. With
/// `without_tls`, the section's URL asks for no TLS and a TLS file is refused with that
/// problem (`"is for TLS; ... use mqtts://"`).
pub(crate) fn tls_files(
    section: &str,
    ca: &Option<PathBuf>,
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
    without_tls: Option<&str>,
) -> Result<(), ConfigError> {
    if cert.is_some() != key.is_some() {
        return Err(invalid(
            format!("{section}.tls_key_file"),
            "tls_cert_file and tls_key_file go together",
        ));
    }
    for (name, path) in [
        ("tls_ca_file", ca),
        ("tls_cert_file", cert),
        ("tls_key_file", key),
    ] {
        let field = format!("{section}.{name}");
        if let (Some(_), Some(problem)) = (path, without_tls) {
            return Err(invalid(field, problem));
        }
        readable_file(&field, path)?;
    }
    Ok(())
}

/// Every timeout named is at least 100 ms.
pub(crate) fn at_least_100ms(timeouts: &[(&str, Duration)]) -> Result<(), ConfigError> {
    match timeouts
        .iter()
        .find(|(_, d)| *d < Duration::from_millis(100))
    {
        Some((field, _)) => Err(invalid(*field, "must be at least 100ms")),
        None => Ok(()),
    }
}

/// What the broker sections' unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    use crate::config::Config;

    /// The error `text` is refused with.
    pub(crate) fn refused(text: &str) -> String {
        Config::parse(text).expect_err("refused").to_string()
    }

    /// Each config text is refused with an error that names its field.
    pub(crate) fn assert_fields_named(cases: impl IntoIterator<Item = (String, &'static str)>) {
        for (text, field) in cases {
            let e = refused(&text);
            assert!(e.contains(field), "{field}: {e}");
        }
    }
}
