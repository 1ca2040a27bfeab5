//! The HTTP API (admin routes, ingest, dashboard, metrics) on its own tokio runtime, for
//! the run modes that serve it.

use std::sync::Arc;
use std::time::Duration;

use super::{RunError, Shutdown};
use crate::admin::{AdminState, HttpConfig};
use crate::config::Config;
use crate::ledger::Ledger;

/// A running HTTP server. It stops when its `stop` token triggers; in-flight requests
/// finish first.
pub struct HttpServer {
    runtime: tokio::runtime::Runtime,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: Shutdown,
}

impl HttpServer {
    /// Binds `http.bind` and serves the API over `ledger` until `stop` triggers.
    pub(crate) fn start(
        ledger: &Arc<Ledger>,
        config: &Config,
        http: HttpConfig,
        stop: Shutdown,
    ) -> Result<HttpServer, RunError> {
        let token = http.resolve_token()?;
        let bind = http.bind;
        let mut config = config.clone();
        config.http = Some(http);
        let state = AdminState::new(ledger.clone(), &config, token)?;
        HttpServer::spawn(state, bind, stop, false)
    }

    /// Binds `bind` and serves only `/metrics`, `/healthz` and `/readyz` (`[metrics]`)
    /// until `stop` triggers.
    pub(crate) fn start_metrics(
        ledger: &Arc<Ledger>,
        bind: std::net::SocketAddr,
        stop: Shutdown,
    ) -> Result<HttpServer, RunError> {
        let state = AdminState::metrics_only(ledger.clone())?;
        HttpServer::spawn(state, bind, stop, true)
    }

    fn spawn(
        state: AdminState,
        bind: std::net::SocketAddr,
        stop: Shutdown,
        metrics_only: bool,
    ) -> Result<HttpServer, RunError> {
        let listener = std::net::TcpListener::bind(bind)
            .map_err(|source| RunError::Listen { addr: bind, source })?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let mut runtime = tokio::runtime::Builder::new_multi_thread();
        runtime.enable_all().thread_name("dedupd-http");
        if metrics_only {
            runtime.worker_threads(1);
        }
        let runtime = runtime.build()?;
        let stopped = stop.clone();
        let task = runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            let until = async move { stopped.triggered().await };
            if metrics_only {
                crate::admin::serve_metrics(listener, state, until).await
            } else {
                crate::admin::serve(listener, state, until).await
            }
        });
        if metrics_only {
            eprintln!("dedupd: metrics on http://{addr}/metrics");
        } else {
            eprintln!(
                "dedupd: HTTP API on http://{addr} (dashboard at /, OpenAPI at /openapi.json)"
            );
        }
        Ok(HttpServer {
            runtime,
            task,
            stop,
        })
    }

    /// Waits until the server stops (its token triggered and requests in progress ended).
    pub(crate) fn join(self) -> Result<(), RunError> {
        let HttpServer { runtime, task, .. } = self;
        let served = runtime.block_on(task);
        runtime.shutdown_timeout(Duration::from_secs(5));
        served
            .map_err(|e| RunError::Server(e.to_string()))?
            .map_err(RunError::Io)
    }

    /// Stops accepting requests, lets requests in progress finish, and waits.
    pub(crate) fn stop(self) -> Result<(), RunError> {
        self.stop.trigger(super::Cause::Requested);
        self.join()
    }
}
