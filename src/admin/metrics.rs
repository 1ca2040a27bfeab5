//! `/metrics`: Prometheus text. One process-wide `metrics-exporter-prometheus` recorder
//! serves every `metrics` facade user (ingest latency here, Kafka lag elsewhere); at scrape
//! time the engine's own counters (per subscriber, per shard, storage) are copied in.
//! Every name is a constant in [`crate::telemetry::metric`].

use std::sync::atomic::Ordering::Relaxed;
use std::sync::OnceLock;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use metrics::{counter, gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use super::{AdminState, ApiError};
use crate::ledger::{ShardMetrics, SubscriberCounters, SubscriberReport};
use crate::telemetry::{metric, process};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the recorder once per process. If another recorder was installed first, its
/// metrics are not rendered here (logged once).
pub(super) fn install() {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets(&[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
            ])
            .map(|b| b.build_recorder())
            .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
        let handle = recorder.handle();
        match metrics::set_global_recorder(recorder) {
            Ok(()) => {
                for (name, help) in metric::HELP.iter().chain(process::HELP) {
                    // One description per name, whatever its kind.
                    metrics::describe_gauge!(*name, *help);
                }
                Some(handle)
            }
            Err(_) => {
                tracing::warn!("a metrics recorder was installed before the admin server; /metrics shows only engine counters");
                None
            }
        }
    });
}

/// Copies the engine's counters into the recorder.
fn sample(st: &AdminState) -> Result<(), ApiError> {
    let ledger = st.ledger();
    let report = ledger.report()?;
    for sub in ledger.subscribers() {
        sample_counters(&sub.name, &sub.counters);
    }
    for row in &report.subscribers {
        sample_storage(row);
    }
    gauge!(metric::DISK_BYTES).set(crate::ledger::tree_bytes(ledger.data_dir()) as f64);
    gauge!(metric::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"),
        "revision" => crate::REVISION,
        "format" => crate::ledger::FORMAT_VERSION.to_string())
    .set(1.0);
    gauge!(metric::OUTBOX_ROWS).set(ledger.outbox_len()? as f64);
    for (i, m) in ledger.metrics().iter().enumerate() {
        sample_shard(i, m);
    }
    gauge!(metric::HTTP_REQUESTS_WAITING).set(st.ingest().waiting() as f64);
    gauge!(metric::READY).set(if ledger.poison_reason().is_none() {
        1.0
    } else {
        0.0
    });
    sample_process();
    Ok(())
}

/// The `process_*` metrics of this process (Linux; none elsewhere). CPU seconds are a
/// gauge to the facade (its counters are integers) and render as such.
fn sample_process() {
    let Some(p) = process::read() else {
        return;
    };
    gauge!(process::CPU_SECONDS_TOTAL).set(p.cpu_seconds);
    gauge!(process::RESIDENT_MEMORY_BYTES).set(p.resident_bytes as f64);
    gauge!(process::VIRTUAL_MEMORY_BYTES).set(p.virtual_bytes as f64);
    gauge!(process::OPEN_FDS).set(p.open_fds as f64);
    if let Some(max) = p.max_fds {
        gauge!(process::MAX_FDS).set(max as f64);
    }
    gauge!(process::START_TIME_SECONDS).set(p.start_time_seconds);
    gauge!(process::THREADS).set(p.threads as f64);
}

/// One subscriber's live counters.
fn sample_counters(name: &str, c: &SubscriberCounters) {
    let name = name.to_string();
    counter!(metric::MESSAGES_PROCESSED_TOTAL, "subscriber" => name.clone())
        .absolute(c.processed.load(Relaxed));
    counter!(metric::DUPLICATES_SKIPPED_TOTAL, "subscriber" => name.clone())
        .absolute(c.duplicates.load(Relaxed));
    counter!(metric::QUARANTINED_TOTAL, "subscriber" => name.clone())
        .absolute(c.quarantined.load(Relaxed));
    counter!(metric::DEAD_LETTERED_TOTAL, "subscriber" => name.clone())
        .absolute(c.dead_lettered.load(Relaxed));
    counter!(metric::HANDLER_RETRIES_TOTAL, "subscriber" => name.clone())
        .absolute(c.retries.load(Relaxed));
    counter!(metric::SLIDING_REFRESHES_TOTAL, "subscriber" => name.clone())
        .absolute(c.sliding_refreshes.load(Relaxed));
    for (kind, dropped) in [
        ("quarantine", &c.quarantine_records_dropped),
        ("dead_letter", &c.dead_letter_records_dropped),
    ] {
        for (reason, n) in [("retention", &dropped.expired), ("cap", &dropped.evicted)] {
            counter!(metric::RECORDS_DROPPED_TOTAL, "subscriber" => name.clone(),
                "kind" => kind, "reason" => reason)
            .absolute(n.load(Relaxed));
        }
    }
    for (kind, n) in c.handler_failures_by_kind() {
        counter!(metric::HANDLER_FAILURES_TOTAL, "subscriber" => name.clone(), "kind" => kind)
            .absolute(n);
    }
    counter!(metric::HANDLER_CALLS_SKIPPED_TOTAL, "subscriber" => name.clone())
        .absolute(c.handler_calls_skipped.load(Relaxed));
    counter!(metric::HANDLER_CALLS_DEFERRED_TOTAL, "subscriber" => name.clone())
        .absolute(c.handler_calls_deferred.load(Relaxed));
    counter!(metric::HANDLER_CIRCUITS_OPENED_TOTAL, "subscriber" => name.clone())
        .absolute(c.handler_circuits_opened.load(Relaxed));
    let probes = c.filter_probes.load(Relaxed);
    let fps = c.filter_false_positives.load(Relaxed);
    counter!(metric::FILTER_PROBES_TOTAL, "subscriber" => name.clone()).absolute(probes);
    counter!(metric::FILTER_FALSE_POSITIVES_TOTAL, "subscriber" => name.clone()).absolute(fps);
    gauge!(metric::FILTER_FALSE_POSITIVE_RATIO, "subscriber" => name.clone()).set(if probes == 0 {
        0.0
    } else {
        fps as f64 / probes as f64
    });
}

/// One subscriber's stored claims, records and memory.
fn sample_storage(row: &SubscriberReport) {
    let name = row.subscriber.clone();
    gauge!(metric::CLAIMS_STORED, "subscriber" => name.clone()).set(row.claims as f64);
    gauge!(metric::ACTIVE_CLAIMS, "subscriber" => name.clone()).set(row.active_claims as f64);
    gauge!(metric::SEALED_GENERATIONS, "subscriber" => name.clone())
        .set(row.sealed_generations as f64);
    gauge!(metric::QUARANTINE_RECORDS, "subscriber" => name.clone())
        .set(row.quarantine_records as f64);
    gauge!(metric::DEAD_LETTER_RECORDS, "subscriber" => name.clone())
        .set(row.dead_letter_records as f64);
    gauge!(metric::FILTER_MEMORY_BYTES, "subscriber" => name.clone()).set(row.filter_bytes as f64);
    gauge!(metric::INDEX_MEMORY_BYTES, "subscriber" => name).set(row.index_bytes as f64);
}

/// One shard's batch and commit figures.
fn sample_shard(i: usize, m: &ShardMetrics) {
    let shard = i.to_string();
    counter!(metric::BATCHES_TOTAL, "shard" => shard.clone()).absolute(m.batches);
    counter!(metric::COMMITS_TOTAL, "shard" => shard.clone()).absolute(m.commits);
    counter!(metric::SHARD_MESSAGES_TOTAL, "shard" => shard.clone()).absolute(m.messages);
    counter!(metric::GENERATIONS_SEALED_TOTAL, "shard" => shard.clone()).absolute(m.seals);
    counter!(metric::GENERATIONS_MERGED_TOTAL, "shard" => shard.clone()).absolute(m.merges);
    counter!(metric::GENERATIONS_DROPPED_TOTAL, "shard" => shard.clone())
        .absolute(m.dropped_generations);
    counter!(metric::PROBED_KEYS_TOTAL, "shard" => shard.clone()).absolute(m.probed_keys);
    counter!(metric::UNPROBED_KEYS_TOTAL, "shard" => shard.clone()).absolute(m.unprobed_keys);
    gauge!(metric::COMMIT_DURATION_MAX_SECONDS, "shard" => shard.clone())
        .set(m.max_commit_us as f64 / 1e6);
    gauge!(metric::BATCH_DURATION_MAX_SECONDS, "shard" => shard)
        .set(m.max_batch_us_plain.max(m.max_batch_us_maintenance) as f64 / 1e6);
}

#[utoipa::path(get, path = "/metrics", tag = "service", operation_id = "metrics",
    summary = "Prometheus text format",
    responses(
        (status = 200, description = "The metrics", content_type = "text/plain", body = String),
        (status = 503, description = "The engine stopped after a storage error", body = crate::admin::ErrorBody),
    ))]
pub(super) async fn render(State(st): State<AdminState>) -> Result<impl IntoResponse, ApiError> {
    let text = tokio::task::spawn_blocking(move || -> Result<String, ApiError> {
        sample(&st)?;
        Ok(match HANDLE.get().and_then(|h| h.as_ref()) {
            Some(h) => {
                h.run_upkeep();
                h.render()
            }
            None => String::new(),
        })
    })
    .await
    .map_err(|e| ApiError::Internal(format!("metrics task failed: {e}")))??;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    ))
}

/// Records one ingest request's latency, by outcome.
pub(super) fn observe_ingest(outcome: &'static str, seconds: f64) {
    metrics::histogram!(metric::HTTP_INGEST_DURATION_SECONDS, "outcome" => outcome).record(seconds);
}
