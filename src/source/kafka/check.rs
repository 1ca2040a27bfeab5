//! `dedupd config check`: the `[kafka]` section's librdkafka options, tried by creating
//! the clients `dedupd run` would create, without connecting.

use rdkafka::config::ClientConfig;
use rdkafka::consumer::BaseConsumer;
use rdkafka::producer::BaseProducer;

use super::{KafkaConfig, KafkaConfigError, KafkaError};

/// Creates (and drops) every client `dedupd run` would create from `kafka`, without its
/// brokers: one consumer per subscription, with the options dedupd sets for it, and the
/// idempotent producer of the outbox relay and the dead-letter topic. librdkafka checks
/// each option's name and value (and values this build cannot support, such as TLS
/// without OpenSSL) when a client is created, so this needs no broker and opens no connection; whether the
/// brokers are reachable is not checked. An error names the field:
/// `kafka.options."NAME": ...`.
pub(crate) fn check_clients(kafka: &KafkaConfig) -> Result<(), KafkaError> {
    for sub in &kafka.subscriptions {
        unconnected(super::consumer::consumer_config(kafka, sub))
            .create::<BaseConsumer>()
            .map_err(|e| refused(kafka, "consumer", e))?;
    }
    if kafka.subscriptions.is_empty() {
        // The options still reach every client: check them on a plain one.
        unconnected(super::client_config(kafka))
            .create::<BaseConsumer>()
            .map_err(|e| refused(kafka, "client", e))?;
    }
    if kafka.outbox.enabled || kafka.dead_letter_topic.is_some() {
        unconnected(super::producer_config(kafka))
            .create::<BaseProducer>()
            .map_err(|e| refused(kafka, "producer", e))?;
    }
    Ok(())
}

/// `config` without its brokers. librdkafka's background threads connect to the
/// bootstrap servers as soon as the clients dedupd uses (a group consumer, an idempotent
/// producer) are created, before any poll, so a client that must not connect is given
/// none (a malformed brokers list is not refused at creation anyway). With Kerberos
/// (`GSSAPI`) librdkafka also runs `sasl.kerberos.kinit.cmd` when the client is created;
/// unless the config sets its refresh interval, the check turns the refresh off so that
/// checking a config obtains no ticket (a missing keytab or `kinit` is not detected).
fn unconnected(mut config: ClientConfig) -> ClientConfig {
    config.remove("bootstrap.servers");
    let gssapi = ["sasl.mechanisms", "sasl.mechanism"]
        .iter()
        .filter_map(|k| config.get(k))
        .any(|m| m.trim().eq_ignore_ascii_case("GSSAPI"));
    const RELOGIN: &str = "sasl.kerberos.min.time.before.relogin";
    if gssapi && config.get(RELOGIN).is_none() {
        config.set(RELOGIN, "0");
    }
    config
}

/// librdkafka's refusal, told as the config field that caused it.
fn refused(kafka: &KafkaConfig, client: &'static str, e: rdkafka::error::KafkaError) -> KafkaError {
    use rdkafka::error::KafkaError as Rd;
    match e {
        Rd::ClientConfig(_, detail, key, _) if kafka.options.contains_key(&key) => {
            KafkaConfigError::Option { key, detail }.into()
        }
        Rd::ClientConfig(_, detail, key, value) => {
            KafkaConfigError::Derived { key, value, detail }.into()
        }
        Rd::ClientCreation(detail) => KafkaConfigError::Client { client, detail }.into(),
        other => KafkaError::Client {
            what: format!("cannot create a Kafka {client}"),
            source: other,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::kafka::SubscriptionConfig;

    fn with_subscription(brokers: &str) -> KafkaConfig {
        let mut k = KafkaConfig::new(brokers);
        k.subscriptions.push(SubscriptionConfig {
            subscriber: "orders".into(),
            topics: vec!["orders".into()],
            group: None,
            changelog: false,
        });
        k
    }

    #[test]
    fn known_options_are_accepted_without_a_broker() {
        let mut k = with_subscription("broker.invalid:9092");
        k.options.insert("client.id".into(), "dedupd-check".into());
        k.options
            .insert("security.protocol".into(), "plaintext".into());
        check_clients(&k).unwrap();
    }

    #[test]
    fn unknown_option_is_refused_with_its_name() {
        let mut k = with_subscription("127.0.0.1:9");
        k.options.insert("no.such.option".into(), "1".into());
        let err = check_clients(&k).unwrap_err().to_string();
        assert!(
            err.starts_with("kafka.options.\"no.such.option\": "),
            "{err}"
        );
    }

    #[test]
    fn bad_option_value_is_refused_with_its_name() {
        let mut k = KafkaConfig::new("127.0.0.1:9");
        k.options
            .insert("security.protocol".into(), "carrier-pigeon".into());
        let err = check_clients(&k).unwrap_err().to_string();
        assert!(
            err.starts_with("kafka.options.\"security.protocol\": "),
            "{err}"
        );
    }
}
