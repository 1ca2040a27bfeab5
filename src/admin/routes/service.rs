//! The service itself: liveness, readiness, the dashboard's page, script and style,
//! `/openapi.json`, and the JSON answers for an unknown route (404) or method (405).

use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use utoipa::ToSchema;

use super::ApiResult;
use crate::admin::{AdminState, ApiError, ErrorBody};

/// `GET /healthz`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Health {
    /// Always `ok`.
    status: &'static str,
}

/// `GET /readyz` when ready.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Ready {
    /// Always `ready`.
    status: &'static str,
    shards: usize,
    subscribers: usize,
}

#[utoipa::path(get, path = "/healthz", tag = "service",
    summary = "The process is up",
    responses((status = 200, description = "Up", body = Health)))]
pub(crate) async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

#[utoipa::path(get, path = "/readyz", tag = "service",
    summary = "Filters loaded and shards writable",
    responses(
        (status = 200, description = "Ready", body = Ready),
        (status = 503, description = "The engine stopped after a storage error, or a broker source is not connected", body = ErrorBody),
    ))]
pub(crate) async fn readyz(State(st): State<AdminState>) -> ApiResult<Json<Ready>> {
    // Ledger::open returns only after filters are loaded and logs replayed (I5); what can
    // change afterwards is a storage error (I4).
    if let Some(reason) = st.ledger().poison_reason() {
        tracing::warn!(%reason, "readyz: the ledger is stopped");
        return Err(ApiError::Unavailable(
            "the engine stopped after a storage error; see its log".into(),
        ));
    }
    // A broker source that lost its connection takes nothing until it reconnects.
    if let Some(reason) = crate::source::readiness::unready() {
        return Err(ApiError::Unavailable(format!("not ready: {reason}")));
    }
    Ok(Json(Ready {
        status: "ready",
        shards: st.ledger().shard_count(),
        subscribers: st.ledger().subscribers().len(),
    }))
}

#[utoipa::path(get, path = "/", tag = "service", operation_id = "dashboard",
    summary = "The dashboard (HTML; polls the JSON API)",
    responses((status = 200, description = "The page", content_type = "text/html", body = String)))]
pub(crate) async fn dashboard_html() -> Html<&'static str> {
    Html(include_str!("../assets/index.html"))
}

#[utoipa::path(get, path = "/assets/app.js", tag = "service",
    summary = "Dashboard script",
    responses((status = 200, description = "The script", content_type = "text/javascript", body = String)))]
pub(crate) async fn dashboard_js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../assets/app.js"),
    )
}

#[utoipa::path(get, path = "/assets/app.css", tag = "service",
    summary = "Dashboard style sheet",
    responses((status = 200, description = "The style sheet", content_type = "text/css", body = String)))]
pub(crate) async fn dashboard_css() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../assets/app.css"),
    )
}

#[utoipa::path(get, path = "/openapi.json", tag = "service", operation_id = "openapi",
    summary = "This document (OpenAPI 3.1)",
    responses((status = 200, description = "The document", body = Object)))]
pub(crate) async fn openapi_json() -> Json<&'static Value> {
    Json(crate::admin::openapi())
}

/// 405 with a JSON body, like every other error.
pub(crate) async fn wrong_method(method: Method, uri: Uri) -> Response {
    let body = json!({
        "error": "method_not_allowed",
        "message": format!("{} does not take {method}; /openapi.json lists its methods", uri.path()),
    });
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

/// The `[metrics]` listener's 405: its routes take GET.
pub(crate) async fn wrong_metrics_method(method: Method, uri: Uri) -> Response {
    let body = json!({
        "error": "method_not_allowed",
        "message": format!("{} does not take {method}; it takes GET", uri.path()),
    });
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

/// The `[metrics]` listener's 404: it serves three routes and no API description.
pub(crate) async fn no_metrics_route(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!(
        "no route {method} {}; this listener ([metrics]) serves only /metrics, /healthz and /readyz",
        uri.path()
    ))
}

pub(crate) async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!(
        "no route {method} {}; /openapi.json lists them",
        uri.path()
    ))
}
