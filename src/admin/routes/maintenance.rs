//! Operator actions on the whole engine: compaction (`/v1/maintenance/compact`), backups
//! (`/v1/maintenance/backup`), and the audit log that records every change
//! (`/v1/audit`).

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{audit, blocking, ApiResult};
use crate::admin::{AdminState, ApiError, Authorized};

#[derive(Debug, Deserialize)]
pub struct CompactQuery {
    #[serde(default)]
    seal_all: bool,
}

pub async fn compact(
    State(st): State<AdminState>,
    q: Result<Query<CompactQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let Query(q) = q.map_err(|e| ApiError::bad("seal_all", e.body_text()))?;
    blocking(move || {
        let started = std::time::Instant::now();
        st.ledger().maintain(q.seal_all)?;
        let ms = started.elapsed().as_millis() as u64;
        audit(
            &st,
            "maintenance.compact",
            None,
            json!({"seal_all": q.seal_all, "ms": ms}),
        )?;
        Ok(Json(
            json!({"compacted": true, "seal_all": q.seal_all, "ms": ms}),
        ))
    })
    .await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupRequest {
    /// Directory name inside the backup directory: `[A-Za-z0-9._-]`, not `.` or `..`.
    name: String,
}

pub async fn backup(
    State(st): State<AdminState>,
    b: Result<Json<BackupRequest>, JsonRejection>,
) -> ApiResult<Json<Value>> {
    let Json(req) = b.map_err(|e| ApiError::bad("name", e.body_text()))?;
    let ok = !req.name.is_empty()
        && req.name.len() <= 128
        && req.name != "."
        && req.name != ".."
        && req
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if !ok {
        return Err(ApiError::bad(
            "name",
            "`name` must be 1-128 of A-Z a-z 0-9 . _ - (a directory inside the backup directory)",
        ));
    }
    let root =
        st.0.http
            .backup_dir
            .clone()
            .unwrap_or_else(|| st.ledger().data_dir().join("backups"));
    let dir = root.join(&req.name);
    if dir.exists() {
        return Err(ApiError::Exists(format!(
            "backup {:?} exists already",
            req.name
        )));
    }
    blocking(move || {
        crate::ledger::create_private_dir_all(&root)
            .map_err(|e| ApiError::Internal(format!("cannot create {}: {e}", root.display())))?;
        let report = crate::backup::backup_online(st.ledger(), &dir).map_err(backup_error)?;
        let pause_ms = report.longest_writer_pause_ms();
        audit(
            &st,
            "maintenance.backup",
            None,
            json!({"name": req.name, "bytes": report.bytes, "longest_writer_pause_ms": pause_ms}),
        )?;
        Ok(Json(json!({
            "name": req.name,
            "bytes": report.bytes,
            "files": report.manifest.files.len(),
            "longest_writer_pause_ms": pause_ms,
            "shards": report.shard_copies,
        })))
    })
    .await
}

/// Ledger failures keep their status; anything else about writing the backup is a 500
/// (logged, not sent).
fn backup_error(e: crate::backup::BackupError) -> ApiError {
    match e {
        crate::backup::BackupError::Ledger(e) => e.into(),
        e @ crate::backup::BackupError::NotEmpty { .. } => ApiError::Exists(e.to_string()),
        e => ApiError::Internal(format!("backup failed: {e}")),
    }
}

#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    limit: Option<usize>,
}

pub async fn audit_log(
    _auth: Authorized,
    State(st): State<AdminState>,
    q: Result<Query<AuditQuery>, QueryRejection>,
) -> ApiResult<Json<Value>> {
    let Query(q) = q.map_err(|e| ApiError::bad("limit", e.body_text()))?;
    let limit = q.limit.unwrap_or(100).clamp(1, 10_000);
    blocking(move || {
        let entries =
            st.0.audit
                .tail(limit)
                .map_err(|e| ApiError::Internal(format!("cannot read the audit log: {e}")))?;
        Ok(Json(json!({"entries": entries})))
    })
    .await
}
