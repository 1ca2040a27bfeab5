//! The admin and ingest HTTP API (axum): health, subscribers and their settings, claims,
//! quarantine and dead letters, handler uploads, maintenance, Prometheus metrics, an
//! OpenAPI description, a small dashboard, and `POST /v1/subscribers/{s}/messages` with
//! `Idempotency-Key` semantics. [`router`] builds it; [`serve`] runs it on a listener.
//!
//! Security: the server binds loopback by default and refuses a non-loopback address
//! without a token (`HttpConfig::resolve_token`); with a token, every mutating route and
//! every payload read needs `Authorization: Bearer <token>` (compared in constant time),
//! and what could reveal a payload (claim fingerprints, failure reasons in lists) is
//! redacted without it. Every request first passes `guard`: a `Host` check against DNS
//! rebinding, an `Origin`/content-type check against cross-site writes, the token for
//! every write, a bounded admission queue and a request timeout. Bodies are size-limited,
//! header reads time out, and uploaded components are size-limited and written only under
//! the data directory.
//!
//! Nothing here blocks the async runtime: ledger calls that wait for a shard or for disk
//! run on `spawn_blocking`, and ingest goes through `bridge::Ingest`.
//!
//! Layout: `routes/` (the [`router`] and one file per resource), `guard` (what every
//! request passes first), `error` ([`ApiError`] and its statuses), `bridge` (requests
//! to shard threads and durable outcomes back), `audit`, `metrics` (`/metrics`), `openapi`, `config`
//! (`[http]`). What a request means as a message is `crate::source::http`.

mod audit;
pub(crate) mod bridge;
mod config;
mod error;
mod guard;
mod metrics;
mod openapi;
mod routes;

use std::future::Future;
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::HeaderMap;
use subtle::ConstantTimeEq;

pub(crate) use crate::pipeline::HandlerInfo;

pub(crate) use crate::pipeline::UploadError;

pub(crate) use crate::pipeline::UploadStore;
pub(crate) use audit::Audit;
pub(crate) use config::HttpConfig;
pub use error::{ApiError, ErrorBody};
pub use openapi::openapi;
pub use routes::{metrics_router, router};

use crate::config::Config;
use crate::ledger::Ledger;
use bridge::Ingest;

/// Everything the routes share. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AdminState(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    ingest: Ingest,
    token: Option<String>,
    http: HttpConfig,
    audit: Audit,
    uploads: UploadStore,
    hosts: guard::HostPolicy,
    admission: guard::Admission,
}

impl AdminState {
    /// Wires the API to a ledger opened with `config` (its `[http]` section, or the
    /// defaults). `token` is the resolved bearer token (`HttpConfig::resolve_token`);
    /// `None` leaves every route open (loopback only). Registers the configured
    /// subscribers so they are listed before their first message, and installs the
    /// uploaded handlers found in the data directory.
    pub fn new(
        ledger: Arc<Ledger>,
        config: &Config,
        token: Option<String>,
    ) -> Result<AdminState, UploadError> {
        for sub in &config.subscribers {
            ledger.subscriber(&sub.name)?;
        }
        let uploads = UploadStore::new(ledger.data_dir());
        uploads.install_all(&ledger)?;
        AdminState::build(
            ledger,
            config.http.clone().unwrap_or_default(),
            token,
            uploads,
        )
    }

    /// State for the `[metrics]` listener: reads the ledger only, so it neither registers
    /// subscribers nor installs uploaded handlers (the run or the API server does that).
    pub fn metrics_only(ledger: Arc<Ledger>) -> Result<AdminState, UploadError> {
        let uploads = UploadStore::new(ledger.data_dir());
        AdminState::build(ledger, HttpConfig::default(), None, uploads)
    }

    fn build(
        ledger: Arc<Ledger>,
        http: HttpConfig,
        token: Option<String>,
        uploads: UploadStore,
    ) -> Result<AdminState, UploadError> {
        let audit = Audit::new(ledger.data_dir().join(crate::ledger::AUDIT_LOG));
        let ingest = Ingest::start(ledger)?;
        metrics::install();
        Ok(AdminState(Arc::new(Inner {
            ingest,
            token,
            hosts: guard::HostPolicy::new(&http),
            admission: guard::Admission::new(&http),
            http,
            audit,
            uploads,
        })))
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        self.0.ingest.ledger()
    }

    /// Requests (ingest and replays) waiting for their durable outcome right now.
    pub fn waiting(&self) -> usize {
        self.0.ingest.waiting()
    }

    /// Idempotency keys in flight, and requests waiting for one of them to be released
    /// (`Prefer: wait`) right now.
    pub fn in_flight(&self) -> (usize, usize) {
        self.0.ingest.in_flight()
    }

    fn ingest(&self) -> &Ingest {
        &self.0.ingest
    }
}

/// Installs the process-wide Prometheus recorder behind `/metrics` (idempotent;
/// [`AdminState::new`] calls it). Call it before starting sources that record through the
/// `metrics` facade, or what they record before the admin server starts is lost.
pub(crate) fn install_metrics() {
    metrics::install();
}

/// A GET that carried the configured bearer token (or any request when none is set): the
/// payload reads. Every other method is checked by `guard` before routing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Authorized;

impl FromRequestParts<AdminState> for Authorized {
    type Rejection = ApiError;

    fn from_request_parts(
        parts: &mut Parts,
        state: &AdminState,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        let result = check_token(&parts.headers, state.0.token.as_deref());
        async move { result }
    }
}

/// How much an open read may show. With a token configured, a request without one sees
/// lists and claims with what could reveal a payload (fingerprints, failure reasons)
/// redacted; a wrong token is 403 as everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    Full,
    Redacted,
}

impl FromRequestParts<AdminState> for Access {
    type Rejection = ApiError;

    fn from_request_parts(
        parts: &mut Parts,
        state: &AdminState,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        let token = state.0.token.as_deref();
        let result = if token.is_some() && !parts.headers.contains_key(AUTHORIZATION) {
            Ok(Access::Redacted)
        } else {
            check_token(&parts.headers, token).map(|_| Access::Full)
        };
        async move { result }
    }
}

fn check_token(headers: &HeaderMap, token: Option<&str>) -> Result<Authorized, ApiError> {
    let Some(token) = token else {
        return Ok(Authorized);
    };
    let given = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .ok_or(ApiError::Unauthorized)?;
    // Constant time over the token's bytes; only the length can leak.
    if bool::from(given.trim().as_bytes().ct_eq(token.as_bytes())) {
        Ok(Authorized)
    } else {
        Err(ApiError::Forbidden)
    }
}

/// Runs the API on `listener` until `shutdown` completes, then finishes the requests in
/// progress. HTTP/1.1 only; a connection that does not send a request's headers within
/// `http.header_timeout` (or idles that long between requests) is closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AdminState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let header_timeout = state.0.http.header_timeout;
    serve_app(listener, router(state), header_timeout, shutdown).await
}

/// Serves only `/metrics`, `/healthz` and `/readyz` on `listener` (the `[metrics]`
/// listener) until `shutdown` completes.
pub(crate) async fn serve_metrics(
    listener: tokio::net::TcpListener,
    state: AdminState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let header_timeout = state.0.http.header_timeout;
    serve_app(
        listener,
        routes::metrics_router(state),
        header_timeout,
        shutdown,
    )
    .await
}

async fn serve_app(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    header_timeout: std::time::Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::server::graceful::GracefulShutdown;
    use hyper_util::service::TowerToHyperService;

    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Responses are written whole; waiting to coalesce them (Nagle) only adds latency.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(header_timeout);
        let conn = http.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// A failed `accept`: a connection that went away is nothing; anything else (out of file
/// descriptors, say) is logged and waited out briefly so the loop does not spin.
async fn accept_failed(e: std::io::Error) {
    use std::io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    tracing::warn!(error = %e, "cannot accept an HTTP connection; retrying in 1 s");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
}
