//! `/metrics`: Prometheus text. One process-wide `metrics-exporter-prometheus` recorder
//! serves every `metrics` facade user (ingest latency here, Kafka lag elsewhere); at scrape
//! time the engine's own counters (per subscriber, per shard, storage) are copied in.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::OnceLock;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use metrics::{counter, gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use super::{AdminState, ApiError};

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
            Ok(()) => Some(handle),
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
        let c = &sub.counters;
        let name = sub.name.to_string();
        counter!("dedupd_messages_processed_total", "subscriber" => name.clone())
            .absolute(c.processed.load(Relaxed));
        counter!("dedupd_duplicates_skipped_total", "subscriber" => name.clone())
            .absolute(c.duplicates.load(Relaxed));
        counter!("dedupd_quarantined_total", "subscriber" => name.clone())
            .absolute(c.quarantined.load(Relaxed));
        counter!("dedupd_dead_lettered_total", "subscriber" => name.clone())
            .absolute(c.dead_lettered.load(Relaxed));
        counter!("dedupd_handler_retries_total", "subscriber" => name.clone())
            .absolute(c.retries.load(Relaxed));
        counter!("dedupd_sliding_refreshes_total", "subscriber" => name.clone())
            .absolute(c.sliding_refreshes.load(Relaxed));
        for (kind, dropped) in [
            ("quarantine", &c.quarantine_records_dropped),
            ("dead_letter", &c.dead_letter_records_dropped),
        ] {
            for (reason, n) in [("retention", &dropped.expired), ("cap", &dropped.evicted)] {
                counter!("dedupd_records_dropped_total", "subscriber" => name.clone(),
                    "kind" => kind, "reason" => reason)
                .absolute(n.load(Relaxed));
            }
        }
        for (kind, n) in c.handler_failures_by_kind() {
            counter!("dedupd_handler_failures_total", "subscriber" => name.clone(), "kind" => kind)
                .absolute(n);
        }
        let probes = c.filter_probes.load(Relaxed);
        let fps = c.filter_false_positives.load(Relaxed);
        counter!("dedupd_filter_probes_total", "subscriber" => name.clone()).absolute(probes);
        counter!("dedupd_filter_false_positives_total", "subscriber" => name.clone()).absolute(fps);
        gauge!("dedupd_filter_false_positive_ratio", "subscriber" => name.clone()).set(
            if probes == 0 {
                0.0
            } else {
                fps as f64 / probes as f64
            },
        );
    }
    for row in &report.subscribers {
        let name = row.subscriber.clone();
        gauge!("dedupd_claims_stored", "subscriber" => name.clone()).set(row.claims as f64);
        gauge!("dedupd_active_claims", "subscriber" => name.clone()).set(row.active_claims as f64);
        gauge!("dedupd_sealed_generations", "subscriber" => name.clone())
            .set(row.sealed_generations as f64);
        gauge!("dedupd_quarantine_records", "subscriber" => name.clone())
            .set(row.quarantine_records as f64);
        gauge!("dedupd_dead_letter_records", "subscriber" => name.clone())
            .set(row.dead_letter_records as f64);
        gauge!("dedupd_filter_memory_bytes", "subscriber" => name.clone())
            .set(row.filter_bytes as f64);
        gauge!("dedupd_index_memory_bytes", "subscriber" => name).set(row.index_bytes as f64);
    }
    gauge!("dedupd_disk_bytes").set(report.file_bytes as f64);
    for (i, m) in ledger.metrics().iter().enumerate() {
        let shard = i.to_string();
        counter!("dedupd_batches_total", "shard" => shard.clone()).absolute(m.batches);
        counter!("dedupd_commits_total", "shard" => shard.clone()).absolute(m.commits);
        counter!("dedupd_shard_messages_total", "shard" => shard.clone()).absolute(m.messages);
        counter!("dedupd_generations_sealed_total", "shard" => shard.clone()).absolute(m.seals);
        counter!("dedupd_generations_merged_total", "shard" => shard.clone()).absolute(m.merges);
        counter!("dedupd_generations_dropped_total", "shard" => shard.clone())
            .absolute(m.dropped_generations);
        gauge!("dedupd_commit_duration_max_seconds", "shard" => shard.clone())
            .set(m.max_commit_us as f64 / 1e6);
        gauge!("dedupd_batch_duration_max_seconds", "shard" => shard)
            .set(m.max_batch_us_plain.max(m.max_batch_us_maintenance) as f64 / 1e6);
    }
    gauge!("dedupd_http_requests_waiting").set(st.ingest().waiting() as f64);
    gauge!("dedupd_ready").set(if ledger.poison_reason().is_none() {
        1.0
    } else {
        0.0
    });
    Ok(())
}

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
    metrics::histogram!("dedupd_http_ingest_duration_seconds", "outcome" => outcome)
        .record(seconds);
}
