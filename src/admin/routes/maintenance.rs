//! Operator actions on the whole engine: compaction (`/v1/maintenance/compact`), backups
//! (`/v1/maintenance/backup`), and the audit log that records every change
//! (`/v1/audit`).

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::{IntoParams, ToSchema};

use super::{audit, blocking, ApiResult};
use crate::admin::{AdminState, ApiError, Authorized, ErrorBody};
use crate::ledger::ShardCopy;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct CompactQuery {
    /// Seal the active generations first, so everything expired can be dropped now.
    #[serde(default)]
    seal_all: bool,
}

/// A compaction done.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Compacted {
    /// Always `true`.
    compacted: bool,
    seal_all: bool,
    /// How long it took.
    ms: u64,
}

#[utoipa::path(post, path = "/v1/maintenance/compact", tag = "maintenance",
    summary = "Run sealing, merging and expiry now (?seal_all=true seals active generations first)",
    params(CompactQuery),
    responses(
        (status = 200, description = "Done", body = Compacted),
        (status = 400, description = "`seal_all` is not a boolean", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn compact(
    State(st): State<AdminState>,
    q: Result<Query<CompactQuery>, QueryRejection>,
) -> ApiResult<Json<Compacted>> {
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
        Ok(Json(Compacted {
            compacted: true,
            seal_all: q.seal_all,
            ms,
        }))
    })
    .await
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BackupRequest {
    /// Directory name inside the backup directory: 1-128 of `[A-Za-z0-9._-]`, not `.` or
    /// `..`.
    #[schema(min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9._-]+$")]
    name: String,
}

/// A backup written.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct BackupDone {
    name: String,
    /// Bytes written.
    bytes: u64,
    /// Files in the backup's manifest.
    files: usize,
    /// The longest any shard's writer was paused for the copy, in milliseconds.
    longest_writer_pause_ms: f64,
    /// One entry per shard file.
    shards: Vec<ShardCopy>,
}

#[utoipa::path(post, path = "/v1/maintenance/backup", tag = "maintenance",
    summary = "Back up into the backup directory: every shard at a commit boundary, handlers, audit log, backup.json with checksums",
    request_body(content = BackupRequest, description = "The backup's directory name"),
    responses(
        (status = 200, description = "Written", body = BackupDone),
        (status = 400, description = "Not a usable name, or not such an object", body = ErrorBody),
        (status = 409, description = "A backup of that name exists already", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn backup(
    State(st): State<AdminState>,
    b: Result<Json<BackupRequest>, JsonRejection>,
) -> ApiResult<Json<BackupDone>> {
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
        Ok(Json(BackupDone {
            name: req.name,
            bytes: report.bytes,
            files: report.manifest.files.len(),
            longest_writer_pause_ms: pause_ms,
            shards: report.shard_copies,
        }))
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

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct AuditQuery {
    /// How many of the newest entries (default 100; clamped to 1-10000).
    limit: Option<usize>,
}

/// One operator action as the audit log keeps it: when, what, on which subscriber, and the
/// action's own details (`fields`, `id`, `kind`, `record`, `version`, ...).
#[derive(ToSchema)]
#[allow(
    dead_code,
    reason = "describes the audit entries for the API document; never built"
)]
pub(crate) struct AuditEntry {
    at_ms: u64,
    /// `config.update`, `claim.forget`, `record.discard`, `record.replay`,
    /// `handler.upload`, `handler.rollback`, `maintenance.compact`, `maintenance.backup`.
    action: String,
    subscriber: Option<String>,
}

/// The newest audit entries, oldest first.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct AuditLog {
    #[schema(value_type = Vec<AuditEntry>)]
    entries: Vec<Value>,
}

#[utoipa::path(get, path = "/v1/audit", tag = "maintenance",
    summary = "The newest operator actions (?limit=N)",
    params(AuditQuery),
    responses(
        (status = 200, description = "Oldest first", body = AuditLog),
        (status = 400, description = "`limit` is not a number", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn audit_log(
    _auth: Authorized,
    State(st): State<AdminState>,
    q: Result<Query<AuditQuery>, QueryRejection>,
) -> ApiResult<Json<AuditLog>> {
    let Query(q) = q.map_err(|e| ApiError::bad("limit", e.body_text()))?;
    let limit = q.limit.unwrap_or(100).clamp(1, 10_000);
    blocking(move || {
        let entries =
            st.0.audit
                .tail(limit)
                .map_err(|e| ApiError::Internal(format!("cannot read the audit log: {e}")))?;
        Ok(Json(AuditLog { entries }))
    })
    .await
}
