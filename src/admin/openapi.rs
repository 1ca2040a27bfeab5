//! `/openapi.json`: the route table and the OpenAPI 3.1 document built from it. A test
//! checks that every route the router serves is listed here and every listed one is served.

use serde_json::{json, Map, Value};

/// One operation of the API.
#[derive(Debug, Clone, Copy)]
pub struct RouteDoc {
    pub method: &'static str,
    pub path: &'static str,
    pub summary: &'static str,
    /// Needs the bearer token when one is configured.
    pub auth: bool,
    /// Statuses it can answer with (besides 401/403 for `auth` routes, and those every
    /// route can answer: see [`openapi`]).
    pub statuses: &'static [u16],
}

const fn r(
    method: &'static str,
    path: &'static str,
    summary: &'static str,
    auth: bool,
    statuses: &'static [u16],
) -> RouteDoc {
    RouteDoc {
        method,
        path,
        summary,
        auth,
        statuses,
    }
}

/// Every route of [`super::router`].
pub const ROUTES: &[RouteDoc] = &[
    r("get", "/", "The dashboard (HTML; polls the JSON API)", false, &[200]),
    r("get", "/assets/app.js", "Dashboard script", false, &[200]),
    r("get", "/assets/app.css", "Dashboard style sheet", false, &[200]),
    r("get", "/healthz", "The process is up", false, &[200]),
    r("get", "/readyz", "Filters loaded and shards writable", false, &[200, 503]),
    r("get", "/metrics", "Prometheus text format", false, &[200, 503]),
    r("get", "/openapi.json", "This document", false, &[200]),
    r("get", "/v1/subscribers", "Subscribers with their counters and storage", false, &[200, 503]),
    r("get", "/v1/subscribers/{s}", "One subscriber: config, stats, handler", false, &[200, 400, 404]),
    r("get", "/v1/subscribers/{s}/config", "A subscriber's settings", false, &[200, 400, 404]),
    r("put", "/v1/subscribers/{s}/config", "Change settings (ttl, sliding_ttl, key, max_key_bytes, handler limits, retry policy); fields left out keep their value; a 400 names the field", true, &[200, 400, 413]),
    r("get", "/v1/subscribers/{s}/stats", "Processed, duplicates, quarantined, dead-lettered, claims stored, generations, filter false-positive rate, bytes", false, &[200, 400, 404]),
    r("post", "/v1/subscribers/{s}/messages", "Ingest one message keyed by the Idempotency-Key header: 201 first time, 201 + Idempotent-Replayed on a retry, 422 other payload, 409 in flight (or wait with `Prefer: wait=N`), 400 no key or malformed JSON, 403 past ledger.max_implicit_subscribers, 413 too large", true, &[201, 400, 403, 404, 409, 413, 422, 500, 503]),
    r("get", "/v1/subscribers/{s}/messages/{id}", "The live claim of a message id (processed-at, fingerprint, expires-at, handler version); the fingerprint only with the token when one is configured", false, &[200, 400, 403, 404]),
    r("delete", "/v1/subscribers/{s}/messages/{id}", "Forget a claim so the next delivery is processed again (audited)", true, &[200, 400, 404]),
    r("get", "/v1/subscribers/{s}/quarantine", "Quarantined messages, without payloads; reasons, fingerprints and keys only with the token when one is configured; page with ?after=ID&limit=N", false, &[200, 400, 403, 404]),
    r("get", "/v1/subscribers/{s}/quarantine/{rid}", "One quarantined message with its payload", true, &[200, 400, 404]),
    r("delete", "/v1/subscribers/{s}/quarantine/{rid}", "Discard a quarantined message (audited)", true, &[200, 400, 404]),
    r("post", "/v1/subscribers/{s}/quarantine/{rid}/replay", "Reprocess a quarantined message through the current handler; it replaces the conflicting claim (audited)", true, &[200, 400, 404, 503]),
    r("get", "/v1/subscribers/{s}/deadletters", "Dead letters, without payloads; reasons and keys only with the token when one is configured; page with ?after=ID&limit=N", false, &[200, 400, 403, 404]),
    r("get", "/v1/subscribers/{s}/deadletters/{rid}", "One dead letter with its payload", true, &[200, 400, 404]),
    r("delete", "/v1/subscribers/{s}/deadletters/{rid}", "Discard a dead letter (audited)", true, &[200, 400, 404]),
    r("post", "/v1/subscribers/{s}/deadletters/{rid}/replay", "Reprocess a dead letter through the current handler (audited)", true, &[200, 400, 404, 503]),
    r("get", "/v1/subscribers/{s}/handler", "The handler in force and the uploaded current/previous versions", false, &[200, 400, 404]),
    r("put", "/v1/subscribers/{s}/handler", "Upload a WebAssembly component (validated first; installed between batches; the old one kept for rollback)", true, &[200, 400, 413]),
    r("post", "/v1/subscribers/{s}/handler/rollback", "Reinstall the previous uploaded handler", true, &[200, 400, 404]),
    r("post", "/v1/maintenance/compact", "Run sealing, merging and expiry now (?seal_all=true seals active generations first)", true, &[200, 400, 503]),
    r("post", "/v1/maintenance/backup", "Backup into the backup directory: {\"name\": DIR}; every shard at a commit boundary, handlers, audit log, backup.json with checksums", true, &[200, 400, 409]),
    r("get", "/v1/audit", "The newest operator actions (?limit=N)", true, &[200, 400]),
    r("get", "/v1/outbox", "The oldest messages handlers emitted, not yet acknowledged (?limit=N, 1-1000), and how many are pending", true, &[200, 400, 409]),
    r("post", "/v1/outbox/ack", "Delete pulled outbox messages: {\"ids\": [...]}", true, &[200, 400, 409]),
];

fn status_text(code: u16) -> &'static str {
    match code {
        200 => "OK",
        201 => "Created (or replayed, with Idempotent-Replayed: true)",
        400 => "Bad request; the body names the field",
        401 => "Bearer token missing",
        403 => "Bearer token wrong, a write from another origin, or past ledger.max_implicit_subscribers",
        404 => "Not found",
        409 => "Conflict",
        413 => "Body too large",
        415 => "A form content type without a token (a web page can send it cross-origin)",
        421 => "Host is not one of this server's names (http.allowed_hosts)",
        422 => "Idempotency key reused with another payload",
        500 => "Internal error (no internals in the body)",
        503 => "Engine not ready or stopped; or busy / timed out, with Retry-After",
        _ => "",
    }
}

/// The OpenAPI 3.1 document. Besides its own statuses, every route can answer 421 (a
/// `Host` that is not this server's) and 503 (queue full or request timeout, with
/// `Retry-After`); every route that is not a GET also 403 (another `Origin`) and 415 (a
/// form content type without a token).
pub fn openapi() -> Value {
    let mut paths = Map::new();
    for route in ROUTES {
        let mut responses = Map::new();
        let mut codes: Vec<u16> = route.statuses.to_vec();
        codes.extend([421, 503]);
        if route.auth {
            codes.extend([401, 403]);
        }
        if route.method != "get" {
            codes.extend([403, 415]);
        }
        for code in codes {
            responses.insert(code.to_string(), json!({"description": status_text(code)}));
        }
        let mut params = Vec::new();
        for (name, what) in [
            ("s", "subscriber name"),
            ("id", "message id (idempotency key text)"),
            ("rid", "record id"),
        ] {
            if route.path.contains(&format!("{{{name}}}")) {
                params.push(json!({"name": name, "in": "path", "required": true, "description": what, "schema": {"type": "string"}}));
            }
        }
        if route.method == "post" && route.path.ends_with("/messages") {
            params.push(json!({"name": "Idempotency-Key", "in": "header", "required": false, "description": "the message's idempotency key; required unless the subscriber's key source finds one in the body", "schema": {"type": "string"}}));
        }
        let mut op = json!({
            "summary": route.summary,
            "operationId": format!("{} {}", route.method, route.path),
            "parameters": params,
            "responses": responses,
        });
        if route.auth {
            op["security"] = json!([{"bearer": []}]);
        }
        let entry = paths
            .entry(route.path.to_string())
            .or_insert_with(|| json!({}));
        entry[route.method] = op;
    }
    json!({
        "openapi": "3.1.0",
        "info": {"title": "dedupd admin and ingest API", "version": env!("CARGO_PKG_VERSION")},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    })
}
