//! Measurements in one place: the names of every exported metric ([`metric`]), latency
//! histograms and process memory.

use hdrhistogram::Histogram;

pub mod process;
pub(crate) mod sched;

/// Latency histogram in microseconds, 1 µs to 1 h, 3 significant digits.
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency(
            Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap_or_else(|_| {
                Histogram::new(3).unwrap_or_else(|_| unreachable!("3 significant digits is valid"))
            }),
        )
    }
}

impl Latency {
    pub fn record_us(&mut self, us: u64) {
        self.0.saturating_record(us.max(1));
    }

    /// Quantile in milliseconds.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        self.0.value_at_quantile(q) as f64 / 1000.0
    }

    pub(crate) fn max_ms(&self) -> f64 {
        self.0.max() as f64 / 1000.0
    }

    pub(crate) fn count(&self) -> u64 {
        self.0.len()
    }

    /// Adds another histogram's samples (one per client of a multi-client run).
    pub fn merge(&mut self, other: &Latency) {
        // Same bounds on both sides, so adding cannot fail; saturate rather than panic.
        let _ = self.0.add(&other.0);
    }
}

/// Resident set size of this process in bytes (Linux `/proc/self/status`; 0 elsewhere).
/// `VmRSS` is in kB whatever the page size (`statm` counts pages, which are 16 or 64 KiB
/// on some ARM kernels, not 4 KiB).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| vm_rss(&s))
        .unwrap_or(0)
}

/// The `VmRSS:` line of a `/proc/<pid>/status` text, in bytes.
fn vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kib = line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()?;
    Some(kib * 1024)
}

/// Makes the allocator return the freed memory it keeps for reuse to the OS now, instead
/// of after its purge delay (harmless when nothing was allocated through mimalloc).
pub(crate) fn return_freed_memory() {
    // SAFETY: `mi_collect` takes no pointers; it walks mimalloc's own heaps, and is safe
    // to call from any thread at any time, also when nothing was allocated through it.
    #[allow(unsafe_code, reason = "mimalloc's collect; see SAFETY")]
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
}

/// The name of every metric the engine exports through the `metrics` facade (rendered by
/// `/metrics`). Counters end in `_total`; units are in the name; labels come from small
/// fixed sets (subscriber and shard names, outcomes, kinds), never a key or a payload.
pub mod metric {
    // Per subscriber (label `subscriber`), copied from the ledger's counters at scrape time.

    /// Counter: messages whose handler ran and whose claim committed.
    pub(crate) const MESSAGES_PROCESSED_TOTAL: &str = "dedupd_messages_processed_total";
    /// Counter: deliveries skipped as duplicates of a live claim (same key, same payload).
    pub(crate) const DUPLICATES_SKIPPED_TOTAL: &str = "dedupd_duplicates_skipped_total";
    /// Counter: deliveries quarantined (a live claim's key with another payload).
    pub(crate) const QUARANTINED_TOTAL: &str = "dedupd_quarantined_total";
    /// Counter: messages dead-lettered after their handler failed for good.
    pub(crate) const DEAD_LETTERED_TOTAL: &str = "dedupd_dead_lettered_total";
    /// Counter: failed handler attempts that were scheduled again.
    pub(crate) const HANDLER_RETRIES_TOTAL: &str = "dedupd_handler_retries_total";
    /// Counter: duplicates that extended a claim's sliding TTL.
    pub(crate) const SLIDING_REFRESHES_TOTAL: &str = "dedupd_sliding_refreshes_total";
    /// Counter: stored records the ledger removed on its own; labels `kind` (`quarantine`,
    /// `dead_letter`) and `reason` (`retention`, `cap`).
    pub(crate) const RECORDS_DROPPED_TOTAL: &str = "dedupd_records_dropped_total";
    /// Counter: failed handler attempts; label `kind` (retryable, permanent, timeout,
    /// memory, trap).
    pub(crate) const HANDLER_FAILURES_TOTAL: &str = "dedupd_handler_failures_total";
    /// Counter: messages dead-lettered without a handler call while the subscriber's
    /// circuit breaker was open on their shard.
    pub(crate) const HANDLER_CALLS_SKIPPED_TOTAL: &str = "dedupd_handler_calls_skipped_total";
    /// Counter: handler calls set aside while the subscriber used more than its fair
    /// share of a busy shard's time (called later; one message may count several times).
    pub(crate) const HANDLER_CALLS_DEFERRED_TOTAL: &str = "dedupd_handler_calls_deferred_total";
    /// Counter: times a shard's circuit breaker of the subscriber opened
    /// (`handler_breaker_failures` sandbox failures in a row).
    pub(crate) const HANDLER_CIRCUITS_OPENED_TOTAL: &str = "dedupd_handler_circuits_opened_total";
    /// Counter: probes of sealed-generation filters.
    pub(crate) const FILTER_PROBES_TOTAL: &str = "dedupd_filter_probes_total";
    /// Counter: filter probes that answered "maybe" without a stored match.
    pub(crate) const FILTER_FALSE_POSITIVES_TOTAL: &str = "dedupd_filter_false_positives_total";
    /// Gauge, ratio 0-1: false positives per filter probe so far.
    pub(crate) const FILTER_FALSE_POSITIVE_RATIO: &str = "dedupd_filter_false_positive_ratio";
    /// Gauge, claims: claims stored, including expired ones not yet dropped.
    pub(crate) const CLAIMS_STORED: &str = "dedupd_claims_stored";
    /// Gauge, claims: claims in the active (unsealed) generation.
    pub(crate) const ACTIVE_CLAIMS: &str = "dedupd_active_claims";
    /// Gauge, generations: sealed claim generations.
    pub(crate) const SEALED_GENERATIONS: &str = "dedupd_sealed_generations";
    /// Gauge, records: stored quarantine records.
    pub(crate) const QUARANTINE_RECORDS: &str = "dedupd_quarantine_records";
    /// Gauge, records: stored dead-letter records.
    pub(crate) const DEAD_LETTER_RECORDS: &str = "dedupd_dead_letter_records";
    /// Gauge, bytes: memory of the filters (sealed generations, handler uniqueness marks).
    pub(crate) const FILTER_MEMORY_BYTES: &str = "dedupd_filter_memory_bytes";
    /// Gauge, bytes: memory of the in-memory claim maps of the active and sealing
    /// generations.
    pub(crate) const INDEX_MEMORY_BYTES: &str = "dedupd_index_memory_bytes";

    // Per shard (label `shard`).

    /// Counter: batches a shard decided.
    pub(crate) const BATCHES_TOTAL: &str = "dedupd_batches_total";
    /// Counter: durable commits of a shard.
    pub(crate) const COMMITS_TOTAL: &str = "dedupd_commits_total";
    /// Counter: messages a shard decided.
    pub(crate) const SHARD_MESSAGES_TOTAL: &str = "dedupd_shard_messages_total";
    /// Counter: claim generations sealed.
    pub(crate) const GENERATIONS_SEALED_TOTAL: &str = "dedupd_generations_sealed_total";
    /// Counter: sealed generations merged into one.
    pub(crate) const GENERATIONS_MERGED_TOTAL: &str = "dedupd_generations_merged_total";
    /// Counter: sealed generations dropped once every claim in them expired.
    pub(crate) const GENERATIONS_DROPPED_TOTAL: &str = "dedupd_generations_dropped_total";
    /// Counter: keys without a live claim on their shard asked of the other shards (a probe
    /// round trip), for subscribers whose claims may be on several shards.
    pub(crate) const PROBED_KEYS_TOTAL: &str = "dedupd_probed_keys_total";
    /// Counter: such keys decided without a probe: every other shard's published claims
    /// ruled them out.
    pub(crate) const UNPROBED_KEYS_TOTAL: &str = "dedupd_unprobed_keys_total";
    /// Gauge, seconds: the longest durable commit so far.
    pub(crate) const COMMIT_DURATION_MAX_SECONDS: &str = "dedupd_commit_duration_max_seconds";
    /// Gauge, seconds: the longest batch so far (decide, maintenance and commit).
    pub(crate) const BATCH_DURATION_MAX_SECONDS: &str = "dedupd_batch_duration_max_seconds";
    /// Histogram, seconds: each durable commit (the fsync part of a batch or of
    /// maintenance).
    pub(crate) const COMMIT_DURATION_SECONDS: &str = "dedupd_commit_duration_seconds";
    /// Histogram, seconds: each batch, from decide to commit.
    pub(crate) const BATCH_DURATION_SECONDS: &str = "dedupd_batch_duration_seconds";

    // The process.

    /// Gauge, bytes: everything in the data directory.
    pub(crate) const DISK_BYTES: &str = "dedupd_disk_bytes";
    /// Gauge, 0 or 1: 1 while the ledger takes writes (no storage error stopped it).
    pub(crate) const READY: &str = "dedupd_ready";

    // HTTP ingest.

    /// Gauge, requests: ingest requests and replays waiting for their durable outcome.
    pub(crate) const HTTP_REQUESTS_WAITING: &str = "dedupd_http_requests_waiting";
    /// Histogram, seconds: each ingest request, received to answered; label `outcome`.
    pub(crate) const HTTP_INGEST_DURATION_SECONDS: &str = "dedupd_http_ingest_duration_seconds";

    // Kafka.

    /// Gauge, messages: log end minus stored offset, from librdkafka statistics; labels
    /// `topic`, `partition`.
    pub(crate) const KAFKA_CONSUMER_LAG: &str = "dedupd_kafka_consumer_lag";
    /// Counter: Kafka records decided; label `outcome` (processed, duplicate, quarantined,
    /// dead_lettered, rejected).
    pub(crate) const KAFKA_MESSAGES_TOTAL: &str = "dedupd_kafka_messages_total";
    /// Counter: changes replayed from a subscription's changelog when partitions were
    /// assigned (`changelog = true`); label `subscriber`.
    pub(crate) const KAFKA_CHANGELOG_RESTORED_TOTAL: &str = "dedupd_kafka_changelog_restored_total";
    /// Counter: tombstones produced to a subscription's changelog for the records of
    /// expired claims (compaction); label `subscriber`.
    pub(crate) const KAFKA_CHANGELOG_TOMBSTONES_TOTAL: &str =
        "dedupd_kafka_changelog_tombstones_total";
    /// Counter: snapshot records (the current value of one item of handler state)
    /// produced to a subscription's changelog by compaction; label `subscriber`.
    pub(crate) const KAFKA_CHANGELOG_SNAPSHOTS_TOTAL: &str =
        "dedupd_kafka_changelog_snapshots_total";
    // NATS JetStream.

    /// Counter: NATS messages received (redeliveries included); label `subscriber`.
    pub(crate) const NATS_RECEIVED_TOTAL: &str = "dedupd_nats_received_total";
    /// Counter: NATS messages received that the server had delivered before
    /// (`delivered > 1`); label `subscriber`.
    pub(crate) const NATS_REDELIVERED_TOTAL: &str = "dedupd_nats_redelivered_total";
    /// Counter: acknowledgements sent after the outcome was durable; labels `subscriber`,
    /// `kind` (ack, term, nak).
    pub(crate) const NATS_ACKED_TOTAL: &str = "dedupd_nats_acked_total";
    /// Counter: NATS messages decided; labels `subscriber`, `outcome` (processed,
    /// duplicate, quarantined, dead_lettered, rejected).
    pub(crate) const NATS_MESSAGES_TOTAL: &str = "dedupd_nats_messages_total";
    /// Gauge, messages: the durable consumer's `num_pending` (not yet delivered), read
    /// every 5 s; label `subscriber`.
    pub(crate) const NATS_CONSUMER_PENDING: &str = "dedupd_nats_consumer_pending";
    /// Gauge, messages: the durable consumer's `num_ack_pending` (delivered, not yet
    /// acknowledged, all instances), read every 5 s; label `subscriber`.
    pub(crate) const NATS_CONSUMER_ACK_PENDING: &str = "dedupd_nats_consumer_ack_pending";
    // MQTT.

    /// Counter: MQTT messages received (redeliveries included); label `subscriber`.
    pub(crate) const MQTT_RECEIVED_TOTAL: &str = "dedupd_mqtt_received_total";
    /// Counter: MQTT messages received with the DUP flag (sent before, on a connection
    /// that was lost or to a run that was killed); label `subscriber`.
    pub(crate) const MQTT_REDELIVERED_TOTAL: &str = "dedupd_mqtt_redelivered_total";
    /// Counter: PUBACKs queued after the outcome was durable; label `subscriber`.
    pub(crate) const MQTT_ACKED_TOTAL: &str = "dedupd_mqtt_acked_total";
    /// Counter: outcomes made durable after their message's connection was lost, so not
    /// acknowledged (the broker delivers them again); label `subscriber`.
    pub(crate) const MQTT_UNACKED_LOST_TOTAL: &str = "dedupd_mqtt_unacked_lost_total";
    /// Counter: MQTT messages decided; labels `subscriber`, `outcome` (processed,
    /// duplicate, quarantined, dead_lettered, rejected).
    pub(crate) const MQTT_MESSAGES_TOTAL: &str = "dedupd_mqtt_messages_total";
    /// Counter: connections made to the MQTT broker (the first included).
    pub(crate) const MQTT_CONNECTIONS_TOTAL: &str = "dedupd_mqtt_connections_total";

    // RabbitMQ.

    /// Counter: RabbitMQ messages received (redeliveries included); labels `subscriber`,
    /// `queue`.
    pub(crate) const RABBITMQ_RECEIVED_TOTAL: &str = "dedupd_rabbitmq_received_total";
    /// Counter: RabbitMQ messages received with the `redelivered` flag; labels
    /// `subscriber`, `queue`.
    pub(crate) const RABBITMQ_REDELIVERED_TOTAL: &str = "dedupd_rabbitmq_redelivered_total";
    /// Counter: messages settled after the outcome was durable; labels `subscriber`,
    /// `queue`, `kind` (ack, reject, nack).
    pub(crate) const RABBITMQ_ACKED_TOTAL: &str = "dedupd_rabbitmq_acked_total";
    /// Counter: RabbitMQ messages decided; labels `subscriber`, `queue`, `outcome`
    /// (processed, duplicate, quarantined, dead_lettered, rejected).
    pub(crate) const RABBITMQ_MESSAGES_TOTAL: &str = "dedupd_rabbitmq_messages_total";
    /// Gauge, messages: the queue's ready messages (not yet delivered), read every 5 s;
    /// labels `subscriber`, `queue`.
    pub(crate) const RABBITMQ_QUEUE_MESSAGES: &str = "dedupd_rabbitmq_queue_messages";
    /// Counter: sessions lost (connection or channel) and started again.
    pub(crate) const RABBITMQ_RECONNECTS_TOTAL: &str = "dedupd_rabbitmq_reconnects_total";
    /// Gauge, rows: outbox rows pending at the relay's last poll (at most `outbox.batch`).
    pub(crate) const OUTBOX_RELAY_LAG_ROWS: &str = "dedupd_outbox_relay_lag_rows";
    /// Gauge, seconds: age of the oldest pending outbox row at the relay's last poll.
    pub(crate) const OUTBOX_RELAY_LAG_SECONDS: &str = "dedupd_outbox_relay_lag_seconds";
    /// Gauge, rows: outbox rows waiting to be relayed or pulled, all shards (sampled at
    /// scrape time). A warning is logged per shard at 100,000 rows and at each doubling.
    pub(crate) const OUTBOX_ROWS: &str = "dedupd_outbox_rows";

    /// Gauge, always 1: labels `version` (the binary) and `format` (the data directory's
    /// format version), to tell which build serves.
    pub(crate) const BUILD_INFO: &str = "dedupd_build_info";

    /// The `# HELP` text of every name, in the words of its documentation above.
    pub(crate) const HELP: &[(&str, &str)] = &[
        (MESSAGES_PROCESSED_TOTAL, "Messages whose handler ran and whose claim committed."),
        (DUPLICATES_SKIPPED_TOTAL, "Deliveries skipped as duplicates of a live claim (same key, same payload)."),
        (QUARANTINED_TOTAL, "Deliveries quarantined (a live claim's key with another payload)."),
        (DEAD_LETTERED_TOTAL, "Messages dead-lettered after their handler failed for good."),
        (HANDLER_RETRIES_TOTAL, "Failed handler attempts that were scheduled again."),
        (SLIDING_REFRESHES_TOTAL, "Duplicates that extended a claim's sliding TTL."),
        (RECORDS_DROPPED_TOTAL, "Stored records the ledger removed on its own; labels kind (quarantine, dead_letter) and reason (retention, cap)."),
        (HANDLER_FAILURES_TOTAL, "Failed handler attempts; label kind (retryable, permanent, timeout, memory, trap)."),
        (HANDLER_CALLS_SKIPPED_TOTAL, "Messages dead-lettered without a handler call while the subscriber's circuit breaker was open on their shard."),
        (HANDLER_CALLS_DEFERRED_TOTAL, "Handler calls set aside while the subscriber used more than its fair share of a shard's time with other subscribers waiting (called later; a message may count several times)."),
        (HANDLER_CIRCUITS_OPENED_TOTAL, "Times a shard's circuit breaker of the subscriber opened (handler_breaker_failures sandbox failures in a row)."),
        (FILTER_PROBES_TOTAL, "Probes of sealed-generation filters."),
        (FILTER_FALSE_POSITIVES_TOTAL, "Filter probes that answered 'maybe' without a stored match."),
        (FILTER_FALSE_POSITIVE_RATIO, "False positives per filter probe so far."),
        (CLAIMS_STORED, "Claims stored, including expired ones not yet dropped."),
        (ACTIVE_CLAIMS, "Claims in the active (unsealed) generation."),
        (SEALED_GENERATIONS, "Sealed claim generations."),
        (QUARANTINE_RECORDS, "Stored quarantine records."),
        (DEAD_LETTER_RECORDS, "Stored dead-letter records."),
        (FILTER_MEMORY_BYTES, "Memory of the filters (sealed generations, handler uniqueness marks)."),
        (INDEX_MEMORY_BYTES, "Memory of the in-memory claim maps of the active and sealing generations."),
        (BATCHES_TOTAL, "Batches a shard decided."),
        (COMMITS_TOTAL, "Durable commits of a shard."),
        (SHARD_MESSAGES_TOTAL, "Messages a shard decided."),
        (GENERATIONS_SEALED_TOTAL, "Claim generations sealed."),
        (GENERATIONS_MERGED_TOTAL, "Sealed generations merged into one."),
        (GENERATIONS_DROPPED_TOTAL, "Sealed generations dropped once every claim in them expired."),
        (PROBED_KEYS_TOTAL, "Keys without a claim on their shard asked of the other shards (a probe round trip)."),
        (UNPROBED_KEYS_TOTAL, "Keys without a claim on their shard that every other shard's published claims ruled out (no probe)."),
        (COMMIT_DURATION_MAX_SECONDS, "The longest durable commit so far."),
        (BATCH_DURATION_MAX_SECONDS, "The longest batch so far (decide, maintenance and commit)."),
        (COMMIT_DURATION_SECONDS, "Each durable commit (the fsync part of a batch or of maintenance)."),
        (BATCH_DURATION_SECONDS, "Each batch, from decide to commit."),
        (DISK_BYTES, "Bytes of every file in the data directory and below it (shard files, uploaded handlers, backups kept inside it)."),
        (READY, "1 while the ledger takes writes (no storage error stopped it)."),
        (HTTP_REQUESTS_WAITING, "Ingest requests and replays waiting for their durable outcome."),
        (HTTP_INGEST_DURATION_SECONDS, "Each ingest request, received to answered; label outcome."),
        (KAFKA_CONSUMER_LAG, "Log end minus stored offset, from librdkafka statistics; labels subscriber, topic, partition."),
        (KAFKA_MESSAGES_TOTAL, "Kafka records decided; labels subscriber, outcome (processed, duplicate, quarantined, dead_lettered, rejected)."),
        (KAFKA_CHANGELOG_RESTORED_TOTAL, "Changes replayed from a subscription's changelog when partitions were assigned; label subscriber."),
        (KAFKA_CHANGELOG_TOMBSTONES_TOTAL, "Tombstones produced to a subscription's changelog for the records of expired claims; label subscriber."),
        (KAFKA_CHANGELOG_SNAPSHOTS_TOTAL, "Snapshot records (the current value of one item of handler state) produced to a subscription's changelog by compaction; label subscriber."),
        (NATS_RECEIVED_TOTAL, "NATS messages received (redeliveries included); label subscriber."),
        (NATS_REDELIVERED_TOTAL, "NATS messages received that the server had delivered before (delivered > 1); label subscriber."),
        (NATS_ACKED_TOTAL, "NATS acknowledgements sent after the outcome was durable; labels subscriber, kind (ack, term, nak)."),
        (NATS_MESSAGES_TOTAL, "NATS messages decided; labels subscriber, outcome (processed, duplicate, quarantined, dead_lettered, rejected)."),
        (NATS_CONSUMER_PENDING, "The durable consumer's num_pending (not yet delivered), read every 5 s; label subscriber."),
        (NATS_CONSUMER_ACK_PENDING, "The durable consumer's num_ack_pending (delivered, not yet acknowledged, all instances), read every 5 s; label subscriber."),
        (RABBITMQ_RECEIVED_TOTAL, "RabbitMQ messages received (redeliveries included); labels subscriber, queue."),
        (RABBITMQ_REDELIVERED_TOTAL, "RabbitMQ messages received with the redelivered flag; labels subscriber, queue."),
        (RABBITMQ_ACKED_TOTAL, "RabbitMQ messages settled after the outcome was durable; labels subscriber, queue, kind (ack, reject, nack)."),
        (RABBITMQ_MESSAGES_TOTAL, "RabbitMQ messages decided; labels subscriber, queue, outcome (processed, duplicate, quarantined, dead_lettered, rejected)."),
        (RABBITMQ_QUEUE_MESSAGES, "The queue's ready messages (not yet delivered), read every 5 s; labels subscriber, queue."),
        (RABBITMQ_RECONNECTS_TOTAL, "RabbitMQ sessions lost (connection or channel) and started again."),
        (OUTBOX_RELAY_LAG_ROWS, "Outbox rows pending at the relay's last poll (at most outbox.batch)."),
        (OUTBOX_RELAY_LAG_SECONDS, "Age of the oldest pending outbox row at the relay's last poll."),
        (OUTBOX_ROWS, "Outbox rows waiting to be relayed or pulled, all shards (sampled at scrape time). A warning is logged per shard at 100,000 rows and at each doubling."),
        (BUILD_INFO, "Always 1; labels: the binary's version, the commit it was built from (`revision`) and the data directory's format version."),
    ];

    /// Every name above, for checks that the rendered text holds only known names.
    pub const ALL: &[&str] = &[
        MESSAGES_PROCESSED_TOTAL,
        DUPLICATES_SKIPPED_TOTAL,
        QUARANTINED_TOTAL,
        DEAD_LETTERED_TOTAL,
        HANDLER_RETRIES_TOTAL,
        SLIDING_REFRESHES_TOTAL,
        RECORDS_DROPPED_TOTAL,
        HANDLER_FAILURES_TOTAL,
        HANDLER_CALLS_SKIPPED_TOTAL,
        HANDLER_CALLS_DEFERRED_TOTAL,
        HANDLER_CIRCUITS_OPENED_TOTAL,
        FILTER_PROBES_TOTAL,
        FILTER_FALSE_POSITIVES_TOTAL,
        FILTER_FALSE_POSITIVE_RATIO,
        CLAIMS_STORED,
        ACTIVE_CLAIMS,
        SEALED_GENERATIONS,
        QUARANTINE_RECORDS,
        DEAD_LETTER_RECORDS,
        FILTER_MEMORY_BYTES,
        INDEX_MEMORY_BYTES,
        BATCHES_TOTAL,
        COMMITS_TOTAL,
        SHARD_MESSAGES_TOTAL,
        GENERATIONS_SEALED_TOTAL,
        GENERATIONS_MERGED_TOTAL,
        GENERATIONS_DROPPED_TOTAL,
        PROBED_KEYS_TOTAL,
        UNPROBED_KEYS_TOTAL,
        COMMIT_DURATION_MAX_SECONDS,
        BATCH_DURATION_MAX_SECONDS,
        COMMIT_DURATION_SECONDS,
        BATCH_DURATION_SECONDS,
        DISK_BYTES,
        READY,
        HTTP_REQUESTS_WAITING,
        HTTP_INGEST_DURATION_SECONDS,
        KAFKA_CONSUMER_LAG,
        KAFKA_MESSAGES_TOTAL,
        KAFKA_CHANGELOG_RESTORED_TOTAL,
        KAFKA_CHANGELOG_TOMBSTONES_TOTAL,
        KAFKA_CHANGELOG_SNAPSHOTS_TOTAL,
        NATS_RECEIVED_TOTAL,
        NATS_REDELIVERED_TOTAL,
        NATS_ACKED_TOTAL,
        NATS_MESSAGES_TOTAL,
        NATS_CONSUMER_PENDING,
        NATS_CONSUMER_ACK_PENDING,
        RABBITMQ_RECEIVED_TOTAL,
        RABBITMQ_REDELIVERED_TOTAL,
        RABBITMQ_ACKED_TOTAL,
        RABBITMQ_MESSAGES_TOTAL,
        RABBITMQ_QUEUE_MESSAGES,
        RABBITMQ_RECONNECTS_TOTAL,
        OUTBOX_RELAY_LAG_ROWS,
        OUTBOX_RELAY_LAG_SECONDS,
        OUTBOX_ROWS,
        BUILD_INFO,
    ];
}

#[cfg(test)]
mod tests {
    use super::metric;

    #[test]
    fn resident_memory_is_read_in_bytes_whatever_the_page_size() {
        let status = "Name:\tdedupd\nVmPeak:\t  900 kB\nVmRSS:\t   12345 kB\nThreads:\t4\n";
        assert_eq!(super::vm_rss(status), Some(12345 * 1024));
        assert_eq!(super::vm_rss("VmRSS:\t12 MB\n"), None);
        // This process: at least the test binary's own pages, and not absurd.
        let rss = super::rss_bytes();
        assert!((1 << 20..1 << 40).contains(&rss), "{rss}");
    }

    #[test]
    fn metric_names_are_prefixed_snake_case_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for name in metric::ALL {
            assert!(name.starts_with("dedupd_"), "{name}");
            assert!(
                name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{name}"
            );
            assert!(seen.insert(name), "{name} is listed twice");
        }
    }

    /// Every exported name is documented in `docs/http-api.md` (seven were not).
    #[test]
    fn every_metric_is_documented() {
        let doc = include_str!("../docs/http-api.md");
        let missing: Vec<&str> = metric::ALL
            .iter()
            .copied()
            .filter(|name| !doc.contains(&format!("`{name}")))
            .collect();
        assert!(missing.is_empty(), "not in docs/http-api.md: {missing:?}");
    }

    /// Every metric the Grafana dashboard in `docs/` queries is one the engine exports,
    /// and the main families are on it.
    #[test]
    fn the_grafana_dashboard_queries_exported_names() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../docs/grafana-dashboard.json")).unwrap();
        let mut used = std::collections::BTreeSet::new();
        for panel in doc["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = target["expr"].as_str().unwrap();
                let mut rest = expr;
                while let Some(at) = rest.find("dedupd_") {
                    let name: String = rest[at..]
                        .chars()
                        .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                        .collect();
                    rest = &rest[at + name.len()..];
                    let base = ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| name.strip_suffix(s))
                        .filter(|b| metric::ALL.contains(b))
                        .unwrap_or(&name)
                        .to_string();
                    assert!(metric::ALL.contains(&base.as_str()), "{name} in {expr}");
                    used.insert(base);
                }
            }
        }
        for name in [
            metric::MESSAGES_PROCESSED_TOTAL,
            metric::DUPLICATES_SKIPPED_TOTAL,
            metric::BATCH_DURATION_SECONDS,
            metric::DISK_BYTES,
            metric::READY,
            metric::KAFKA_CONSUMER_LAG,
            metric::OUTBOX_ROWS,
        ] {
            assert!(used.contains(name), "{name} is not on the dashboard");
        }
    }

    #[test]
    fn every_metric_has_help_text() {
        for name in metric::ALL {
            let help = metric::HELP.iter().filter(|(n, _)| n == name).count();
            assert_eq!(help, 1, "{name}: {help} HELP entries");
        }
        assert_eq!(metric::HELP.len(), metric::ALL.len());
        assert!(metric::HELP.iter().all(|(_, h)| h.len() > 10));
    }
}
