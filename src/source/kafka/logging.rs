//! librdkafka's log lines and global errors, at a bounded rate. With no broker reachable
//! librdkafka reports every failed connection attempt (492 error lines in 8 s from one
//! consumer on loopback): each kind of line (facility, or error code) is logged at most
//! once per [`EVERY`], and the next one says how many were left out; so is each
//! consumer's poll error, which repeats them. Broker reachability
//! itself goes to `/readyz` (the subscription's probe in `crate::source::readiness`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;

/// At most one line of a kind per this long.
pub(crate) const EVERY: Duration = Duration::from_secs(10);

/// The time each kind was last logged, and how many of it were left out since.
static LAST: Mutex<Option<HashMap<String, (Instant, u64)>>> = Mutex::new(None);

/// `Some(left out since the last one)` when a line of `kind` may be logged now.
fn admit(kind: &str, now: Instant) -> Option<u64> {
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    let map = last.get_or_insert_with(HashMap::new);
    match map.get_mut(kind) {
        Some((at, skipped)) if now.duration_since(*at) < EVERY => {
            *skipped += 1;
            None
        }
        Some((at, skipped)) => {
            *at = now;
            Some(std::mem::take(skipped))
        }
        None => {
            map.insert(kind.to_string(), (now, 0));
            Some(0)
        }
    }
}

/// A librdkafka log line (`ClientContext::log` of every client dedupd creates).
pub(crate) fn log(level: RDKafkaLogLevel, fac: &str, message: &str) {
    if matches!(level, RDKafkaLogLevel::Debug) {
        tracing::debug!(target: "librdkafka", fac, "{message}");
        return;
    }
    let Some(left_out) = admit(&format!("log {fac}"), Instant::now()) else {
        return;
    };
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => {
            tracing::error!(target: "librdkafka", fac, left_out, "{message}")
        }
        RDKafkaLogLevel::Warning => {
            tracing::warn!(target: "librdkafka", fac, left_out, "{message}")
        }
        _ => tracing::info!(target: "librdkafka", fac, left_out, "{message}"),
    }
}

/// A librdkafka global error (`ClientContext::error`).
pub(crate) fn error(error: &KafkaError, reason: &str) {
    let kind = match error.rdkafka_error_code() {
        Some(code) => format!("error {code:?}"),
        None => format!("error {error}"),
    };
    if let Some(left_out) = admit(&kind, Instant::now()) {
        tracing::error!(target: "librdkafka", left_out, "{error}: {reason}");
    }
}

/// An error a consumer's poll returned (librdkafka hands every "all brokers down" to
/// each poll too).
pub(crate) fn consumer_error(subscriber: &str, error: &KafkaError) {
    let kind = match error.rdkafka_error_code() {
        Some(code) => format!("poll {subscriber} {code:?}"),
        None => format!("poll {subscriber} {error}"),
    };
    if let Some(left_out) = admit(&kind, Instant::now()) {
        tracing::warn!(subscriber, left_out, "kafka consumer error: {error}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kind_of_line_is_logged_once_per_period_and_counts_the_rest() {
        let t0 = Instant::now();
        assert_eq!(admit("test FAIL", t0), Some(0));
        for i in 1..=491u64 {
            assert_eq!(admit("test FAIL", t0 + Duration::from_millis(16 * i)), None);
        }
        // Another kind is not held back by the first.
        assert_eq!(admit("test CONFWARN", t0), Some(0));
        assert_eq!(admit("test FAIL", t0 + EVERY), Some(491));
        assert_eq!(admit("test FAIL", t0 + EVERY + EVERY / 2), None);
    }
}
