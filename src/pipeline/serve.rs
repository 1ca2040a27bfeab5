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
    pub fn start(
        ledger: &Arc<Ledger>,
        config: &Config,
        http: HttpConfig,
        stop: Shutdown,
    ) -> Result<HttpServer, RunError> {
        let token = http.resolve_token()?;
        crate::admin::install_metrics();
        let listener =
            std::net::TcpListener::bind(http.bind).map_err(|source| RunError::Listen {
                addr: http.bind,
                source,
            })?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let mut config = config.clone();
        config.http = Some(http);
        let state = AdminState::new(ledger.clone(), &config, token)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("dedupd-http")
            .build()?;
        let stopped = stop.clone();
        let task = runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            crate::admin::serve(listener, state, async move { stopped.triggered().await }).await
        });
        eprintln!("dedupd: HTTP API on http://{addr} (dashboard at /, OpenAPI at /openapi.json)");
        Ok(HttpServer {
            runtime,
            task,
            stop,
        })
    }

    /// Waits until the server stops (its token triggered and requests in progress ended).
    pub fn join(self) -> Result<(), RunError> {
        let HttpServer { runtime, task, .. } = self;
        let served = runtime.block_on(task);
        runtime.shutdown_timeout(Duration::from_secs(5));
        served
            .map_err(|e| RunError::Server(e.to_string()))?
            .map_err(RunError::Io)
    }

    /// Stops accepting requests, lets requests in progress finish, and waits.
    pub fn stop(self) -> Result<(), RunError> {
        self.stop.trigger(super::Cause::Requested);
        self.join()
    }
}
