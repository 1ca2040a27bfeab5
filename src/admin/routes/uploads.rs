//! A subscriber's uploaded handler component (`/v1/subscribers/{s}/handler`): what is
//! installed, uploading a new one, and rolling back to the previous one; the routes over
//! [`crate::admin::UploadStore`].

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::Json;
use serde_json::json;

use super::{audit, blocking, body, check_name, known, path, ApiResult, BinaryBody};
use crate::admin::{AdminState, ApiError, ErrorBody, HandlerInfo, UploadError};

#[utoipa::path(get, path = "/v1/subscribers/{s}/handler", tag = "handlers",
    summary = "The handler in force and the uploaded current/previous versions",
    params(("s" = String, Path, description = "Subscriber name")),
    responses(
        (status = 200, description = "The subscriber's handlers", body = HandlerInfo),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber", body = ErrorBody),
    ))]
pub(crate) async fn get_handler(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<HandlerInfo>> {
    let name = path(p)?;
    known(st.ledger(), &name)?;
    Ok(Json(st.0.uploads.info(st.ledger(), &name)))
}

pub(super) fn upload_error(e: UploadError) -> ApiError {
    match e {
        UploadError::Invalid(h) => ApiError::bad("body", h.to_string()),
        UploadError::NoPrevious => ApiError::NotFound("no previous handler to roll back to".into()),
        UploadError::Ledger(l) => l.into(),
        UploadError::Io(io) => ApiError::Internal(io.to_string()),
        e @ UploadError::Stored { .. } => ApiError::Internal(e.to_string()),
    }
}

#[utoipa::path(put, path = "/v1/subscribers/{s}/handler", tag = "handlers",
    summary = "Upload a WebAssembly component (validated first; installed between batches; the old one kept for rollback)",
    params(("s" = String, Path, description = "Subscriber name; an unknown one is registered (up to ledger.max_implicit_subscribers)")),
    request_body(
        description = "The component's bytes (at most http.max_handler_bytes), under any content type but a form type without a token; application/wasm and application/octet-stream are documented",
        content((inline(BinaryBody) = "application/wasm"), (inline(BinaryBody) = "application/octet-stream")),
    ),
    responses(
        (status = 200, description = "Installed", body = HandlerInfo),
        (status = 400, description = "Empty, or not a component this engine can run", body = ErrorBody),
        (status = 413, description = "Larger than http.max_handler_bytes", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn upload_handler(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
    b: Result<Bytes, BytesRejection>,
) -> ApiResult<Json<HandlerInfo>> {
    let name = path(p)?;
    check_name(&name)?;
    let bytes = body(b, st.0.http.max_handler_bytes)?;
    if bytes.is_empty() {
        return Err(ApiError::bad(
            "body",
            "the body must be a WebAssembly component",
        ));
    }
    blocking(move || {
        let info =
            st.0.uploads
                .upload(st.ledger(), &name, &bytes)
                .map_err(upload_error)?;
        audit(
            &st,
            "handler.upload",
            Some(&name),
            json!({"version": info.current, "bytes": bytes.len()}),
        )?;
        Ok(Json(info))
    })
    .await
}

#[utoipa::path(post, path = "/v1/subscribers/{s}/handler/rollback", tag = "handlers",
    summary = "Reinstall the previous uploaded handler",
    params(("s" = String, Path, description = "Subscriber name")),
    responses(
        (status = 200, description = "Rolled back", body = HandlerInfo),
        (status = 400, description = "Not a valid subscriber name", body = ErrorBody),
        (status = 404, description = "No such subscriber, or no previous handler", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn rollback_handler(
    State(st): State<AdminState>,
    p: Result<Path<String>, PathRejection>,
) -> ApiResult<Json<HandlerInfo>> {
    let name = path(p)?;
    known(st.ledger(), &name)?;
    blocking(move || {
        let info =
            st.0.uploads
                .rollback(st.ledger(), &name)
                .map_err(upload_error)?;
        audit(
            &st,
            "handler.rollback",
            Some(&name),
            json!({"version": info.current}),
        )?;
        Ok(Json(info))
    })
    .await
}
