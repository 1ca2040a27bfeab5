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
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{guard, metrics, AdminState, ApiError};
use crate::config::validate_subscriber_name;
use crate::ledger::{Ledger, Subscriber};

type ApiResult<T> = Result<T, ApiError>;

/// A request body that is bytes as they are (a handler component, an opaque payload), in
/// the document: a binary string (`format: binary`) so that generated clients and fuzzers
/// send raw bytes rather than the JSON array of numbers utoipa makes of a `Vec<u8>`. Only
/// a schema: the routes take the body as [`Bytes`], under whatever content type `guard`
/// lets through.
pub(crate) struct BinaryBody;

impl utoipa::PartialSchema for BinaryBody {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl utoipa::ToSchema for BinaryBody {}

/// Every route with its documentation. Each handler is routed at the method and path its
/// `#[utoipa::path]` annotation names and adds its operation to the document, so the
/// router and `/openapi.json` ([`super::openapi`]) come from this one list. `upload_limit`
/// is the body limit of handler uploads (`http.max_handler_bytes`).
pub(super) fn api(upload_limit: usize) -> OpenApiRouter<AdminState> {
    use claims::*;
    use ingest::*;
    use maintenance::*;
    use outbox::*;
    use records::*;
    use service::*;
    use subscribers::*;
    use uploads::*;
    let (schemas, paths, upload) = routes!(upload_handler);
    let upload = upload.layer(DefaultBodyLimit::max(upload_limit));
    OpenApiRouter::new()
        .routes(routes!(dashboard_html))
        .routes(routes!(dashboard_js))
        .routes(routes!(dashboard_css))
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics::render))
        .routes(routes!(openapi_json))
        .routes(routes!(list_subscribers))
        .routes(routes!(get_subscriber))
        .routes(routes!(get_config, put_config))
        .routes(routes!(get_stats))
        .routes(routes!(ingest_message))
        .routes(routes!(get_claim, forget_claim))
        .routes(routes!(list_quarantine))
        .routes(routes!(get_quarantine, discard_quarantine))
        .routes(routes!(replay_quarantine))
        .routes(routes!(list_deadletters))
        .routes(routes!(get_deadletter, discard_deadletter))
        .routes(routes!(replay_deadletter))
        .routes(routes!(get_handler))
        .routes((schemas, paths, upload))
        .routes(routes!(rollback_handler))
        .routes(routes!(compact))
        .routes(routes!(backup))
        .routes(routes!(audit_log))
        .routes(routes!(pull_outbox))
        .routes(routes!(ack_outbox))
}

/// The whole API: `api` behind `guard`, with JSON answers for an unknown route or method.
pub fn router(state: AdminState) -> Router {
    use service::{no_route, wrong_method};
    let upload_limit = state.0.http.max_handler_bytes;
    let body_limit = state.0.http.max_body_bytes;
    let (routes, _) = api(upload_limit).split_for_parts();
    routes
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

/// What a read without the token left out (`redacted` in a record).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct Redacted {
    /// The fields left out.
    fields: Vec<&'static str>,
    /// Always "send the bearer token to see them".
    why: &'static str,
}

/// Removes `fields` from `v` and says so in `redacted`, so a reader knows to send the token.
fn redact(v: &mut Value, fields: &[&'static str]) {
    if let Some(o) = v.as_object_mut() {
        for f in fields {
            o.remove(*f);
        }
        let redacted = Redacted {
            fields: fields.to_vec(),
            why: "send the bearer token to see them",
        };
        o.insert("redacted".into(), json!(redacted));
    }
}
