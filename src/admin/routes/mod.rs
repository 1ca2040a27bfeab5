//! The routes, one file per resource, and what they share: the [`router`] that assembles
//! them behind `guard`, path and body extraction, subscriber lookup, the blocking-pool
//! hop and the audit trail.
//!
//! - [`service`]: health, readiness, the dashboard's files, `/openapi.json`, the JSON 404
//!   and 405;
//! - [`subscribers`]: the subscriber list, one subscriber, its settings and its stats;
//! - [`claims`]: a message id's live claim, and forgetting it;
//! - [`ingest`]: `POST /v1/subscribers/{s}/messages`, the HTTP source;
//! - [`records`]: quarantine and dead letters: list, read, discard, replay;
//! - [`uploads`]: a subscriber's uploaded handler: read, upload, roll back;
//! - [`maintenance`]: compaction, backups, and the audit log;
//! - [`outbox`]: what handlers emitted, pulled and acknowledged when no Kafka relays it.
//!
//! Each route maps its failures to [`ApiError`]; ledger calls that wait for a shard or the
//! disk run on the blocking pool ([`blocking`]).

mod claims;
mod ingest;
mod maintenance;
mod outbox;
mod records;
mod service;
mod subscribers;
mod uploads;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path};
use axum::handler::Handler;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use super::{guard, metrics, AdminState, ApiError};
use crate::config::validate_subscriber_name;
use crate::ledger::{Ledger, Subscriber};

type ApiResult<T> = Result<T, ApiError>;

/// The whole API. Routes are listed in [`super::ROUTES`] (and so in `/openapi.json`).
pub fn router(state: AdminState) -> Router {
    use claims::*;
    use ingest::*;
    use maintenance::*;
    use outbox::*;
    use records::*;
    use service::*;
    use subscribers::*;
    use uploads::*;
    let upload_limit = state.0.http.max_handler_bytes;
    let body_limit = state.0.http.max_body_bytes;
    Router::new()
        .route("/", get(dashboard_html))
        .route("/assets/app.js", get(dashboard_js))
        .route("/assets/app.css", get(dashboard_css))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics::render))
        .route("/openapi.json", get(openapi_json))
        .route("/v1/subscribers", get(list_subscribers))
        .route("/v1/subscribers/{s}", get(get_subscriber))
        .route(
            "/v1/subscribers/{s}/config",
            get(get_config).put(put_config),
        )
        .route("/v1/subscribers/{s}/stats", get(get_stats))
        .route("/v1/subscribers/{s}/messages", post(ingest_message))
        .route(
            "/v1/subscribers/{s}/messages/{id}",
            get(get_claim).delete(forget_claim),
        )
        .route("/v1/subscribers/{s}/quarantine", get(list_quarantine))
        .route(
            "/v1/subscribers/{s}/quarantine/{rid}",
            get(get_quarantine).delete(discard_quarantine),
        )
        .route(
            "/v1/subscribers/{s}/quarantine/{rid}/replay",
            post(replay_quarantine),
        )
        .route("/v1/subscribers/{s}/deadletters", get(list_deadletters))
        .route(
            "/v1/subscribers/{s}/deadletters/{rid}",
            get(get_deadletter).delete(discard_deadletter),
        )
        .route(
            "/v1/subscribers/{s}/deadletters/{rid}/replay",
            post(replay_deadletter),
        )
        .route(
            "/v1/subscribers/{s}/handler",
            get(get_handler).put(upload_handler.layer(DefaultBodyLimit::max(upload_limit))),
        )
        .route(
            "/v1/subscribers/{s}/handler/rollback",
            post(rollback_handler),
        )
        .route("/v1/maintenance/compact", post(compact))
        .route("/v1/maintenance/backup", post(backup))
        .route("/v1/audit", get(audit_log))
        .route("/v1/outbox", get(pull_outbox))
        .route("/v1/outbox/ack", post(ack_outbox))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            guard::guard,
        ))
        .with_state(state)
}

/// Only `/metrics`, `/healthz` and `/readyz`: the `[metrics]` listener. Nothing here
/// writes or shows a payload, so it has no token and no host check.
pub fn metrics_router(state: AdminState) -> Router {
    use service::*;
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics::render))
        .fallback(no_metrics_route)
        .method_not_allowed_fallback(wrong_metrics_method)
        .with_state(state)
}

fn path<T>(p: Result<Path<T>, PathRejection>) -> ApiResult<T> {
    p.map(|Path(t)| t)
        .map_err(|e| ApiError::bad("path", format!("bad path parameter: {}", e.body_text())))
}

/// The request body; over the route's size `limit` it is 413 naming that limit.
fn body(b: Result<Bytes, BytesRejection>, limit: usize) -> ApiResult<Bytes> {
    b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge { limit }
        } else {
            ApiError::bad("body", e.body_text())
        }
    })
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("blocking task failed: {e}")))?
}

fn check_name(name: &str) -> ApiResult<()> {
    // "." and ".." pass the ledger's alphabet but are directory names on disk.
    if name.bytes().all(|b| b == b'.') {
        return Err(ApiError::bad(
            "subscriber",
            format!("{name:?} is not a usable subscriber name"),
        ));
    }
    validate_subscriber_name("subscriber", name).map_err(|_| {
        ApiError::bad(
            "subscriber",
            format!("{name:?} is not a valid subscriber name (1-64 of A-Z a-z 0-9 . _ -)"),
        )
    })
}

/// A subscriber the ledger knows (configured, on disk or seen in traffic); reads never
/// register new ones.
fn known(ledger: &Ledger, name: &str) -> ApiResult<Arc<Subscriber>> {
    check_name(name)?;
    ledger
        .subscribers()
        .into_iter()
        .find(|s| &*s.name == name)
        .ok_or_else(|| ApiError::NotFound(format!("no subscriber {name:?}")))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn audit(st: &AdminState, action: &str, subscriber: Option<&str>, detail: Value) -> ApiResult<()> {
    st.0.audit
        .record(action, subscriber, detail)
        .map_err(|e| ApiError::Internal(format!("cannot write the audit log: {e}")))
}

/// Removes `fields` from `v` and says so in `redacted`, so a reader knows to send the token.
fn redact(v: &mut Value, fields: &[&str]) {
    if let Some(o) = v.as_object_mut() {
        for f in fields {
            o.remove(*f);
        }
        o.insert(
            "redacted".into(),
            json!({"fields": fields, "why": "send the bearer token to see them"}),
        );
    }
}
