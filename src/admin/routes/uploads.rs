//! A subscriber's uploaded handler component (`/v1/subscribers/{s}/handler`): what is
//! installed, uploading a new one, and rolling back to the previous one; the routes over
//! [`crate::admin::UploadStore`].

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::Json;
use serde_json::json;

use super::{audit, blocking, body, check_name, known, path, ApiResult};
use crate::admin::{AdminState, ApiError, HandlerInfo, UploadError};

pub async fn get_handler(
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

pub async fn upload_handler(
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

pub async fn rollback_handler(
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
