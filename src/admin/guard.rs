//! What every request passes before a route sees it, in one middleware so no route can
//! forget it:
//!
//! 1. **Host.** The `Host` (or HTTP/2 authority) must name this server: the bind address,
//!    on a loopback bind also `localhost`, `127.0.0.1` and `[::1]`, on an unspecified bind
//!    (`0.0.0.0`, `::`) any IP literal, plus `http.allowed_hosts`; else 421. A web page
//!    that re-points its own DNS name at 127.0.0.1 (DNS rebinding) sends its own name, so
//!    it is refused. The port is not compared: a rebinding page cannot change the name,
//!    and the port a client used may differ from the bound one behind a forwarder. A
//!    request without any `Host` is let through: browsers always send one, so it is not a
//!    web page (HTTP/1.0 tools, raw sockets).
//! 2. **Cross-origin writes.** On every method but GET, HEAD and OPTIONS: an `Origin` that
//!    does not pass the same host check (or is `null`) is 403; without a configured token,
//!    the three content types a page may send cross-origin without a CORS preflight
//!    (`text/plain`, `application/x-www-form-urlencoded`, `multipart/form-data`) are 415,
//!    for browsers that omit `Origin`, and so is a body sent with no `Content-Type` at all
//!    (a page's `fetch` with a `Blob` body may omit it). The server never answers CORS
//!    preflights, so any other cross-origin write is stopped by the browser itself.
//! 3. **Token.** With a token configured, every method but GET, HEAD and OPTIONS needs it
//!    (401/403); payload reads check it in their route ([`super::Authorized`]).
//! 4. **Admission.** At most `http.max_concurrency` requests run; `http.max_queued` more
//!    wait up to `http.queue_timeout`; beyond either, 503 `busy` with `Retry-After`.
//! 5. **Time.** A request that takes longer than `http.request_timeout` (its body upload
//!    included) is answered 503 `timeout`. The future is dropped; work already on a shard
//!    or the blocking pool finishes and is durable as usual.
//!
//! Every response carries `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY` and a
//! `Content-Security-Policy` that lets the dashboard load only its own script and style.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{check_token, AdminState, ApiError, HttpConfig};

/// The policy of the dashboard page: its own script, style and API, nothing else.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The names a request may address this server by.
#[derive(Debug, Clone)]
pub(crate) struct HostPolicy {
    bind: IpAddr,
    allowed: Vec<String>,
}

/// `host` lowercased, without a trailing dot or IPv6 brackets.
fn normalize(host: &str) -> String {
    let h = host.trim().trim_end_matches('.').to_ascii_lowercase();
    match h.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
        Some(inner) => inner.to_string(),
        None => h,
    }
}

impl HostPolicy {
    pub(crate) fn new(http: &HttpConfig) -> HostPolicy {
        HostPolicy {
            bind: http.bind.ip(),
            allowed: http.allowed_hosts.iter().map(|h| normalize(h)).collect(),
        }
    }

    /// Whether `host` (a name or IP literal, without port) names this server.
    pub(crate) fn allows(&self, host: &str) -> bool {
        let host = normalize(host);
        if self.allowed.contains(&host) {
            return true;
        }
        let local = self.bind.is_loopback() || self.bind.is_unspecified();
        match host.parse::<IpAddr>() {
            Ok(ip) => {
                ip == self.bind
                    || (self.bind.is_loopback() && ip.is_loopback())
                    // The machine's own addresses are not known here; an IP literal
                    // cannot be re-pointed by DNS, so it is no rebinding vector.
                    || self.bind.is_unspecified()
            }
            Err(_) => local && host == "localhost",
        }
    }

    /// The host part of an authority (`name`, `name:port`, `[v6]:port`).
    fn host_of(authority: &str) -> Option<String> {
        let a: axum::http::uri::Authority = authority.parse().ok()?;
        Some(a.host().to_string())
    }

    fn check_host(&self, req: &Request) -> Result<(), ApiError> {
        let given = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_string())
            .into_iter()
            .chain(
                req.headers()
                    .get_all(header::HOST)
                    .iter()
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
            );
        for authority in given {
            let ok = Self::host_of(&authority).is_some_and(|h| self.allows(&h));
            if !ok {
                return Err(ApiError::MisdirectedHost(format!(
                    "this server does not answer to Host {authority:?}: use its bind address or localhost, or add the name to http.allowed_hosts"
                )));
            }
        }
        Ok(())
    }

    fn check_origin(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(origin) = headers.get(header::ORIGIN) else {
            return Ok(());
        };
        let text = String::from_utf8_lossy(origin.as_bytes());
        let host = text
            .parse::<axum::http::Uri>()
            .ok()
            .and_then(|u| u.host().map(str::to_string));
        if host.is_some_and(|h| self.allows(&h)) {
            return Ok(());
        }
        Err(ApiError::CrossOrigin(format!(
            "a {text:?} page may not change this server (Origin is not one of its hosts; see http.allowed_hosts)"
        )))
    }
}

/// Content types a web page may send to another origin without a CORS preflight.
const SIMPLE_TYPES: &[&str] = &[
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
];

/// The media type of `Content-Type`, lowercased, without parameters.
pub(crate) fn media_type(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::CONTENT_TYPE)?;
    let text = String::from_utf8_lossy(v.as_bytes());
    Some(
        text.split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase(),
    )
}

fn check_simple_type(req: &Request) -> Result<(), ApiError> {
    use axum::body::HttpBody;
    match media_type(req.headers()) {
        Some(t) if SIMPLE_TYPES.contains(&t.as_str()) => Err(ApiError::UnsupportedMediaType(format!(
            "`Content-Type: {t}` is refused on a server without a token (any web page can send it): send application/json, or application/octet-stream (or another type) for an opaque payload"
        ))),
        None if req.body().size_hint().upper() != Some(0) => Err(ApiError::UnsupportedMediaType(
            "a request body without a `Content-Type` is refused on a server without a token (a web page can send one): send application/json, or application/octet-stream (or another type) for an opaque payload".into(),
        )),
        _ => Ok(()),
    }
}

/// Slots for running requests and a bounded queue for the ones waiting.
#[derive(Debug)]
pub(crate) struct Admission {
    slots: Arc<Semaphore>,
    queued: AtomicUsize,
    max_queued: usize,
    queue_timeout: Duration,
}

/// A place in the wait queue, given back on drop.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub(crate) fn new(http: &HttpConfig) -> Admission {
        Admission {
            slots: Arc::new(Semaphore::new(http.max_concurrency)),
            queued: AtomicUsize::new(0),
            max_queued: http.max_queued,
            queue_timeout: http.queue_timeout,
        }
    }

    /// A slot, at once or after a bounded wait. Tokio's semaphore is fair: a freed slot
    /// goes to the longest waiter, so `try_acquire` never jumps the queue.
    async fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        if let Ok(slot) = self.slots.clone().try_acquire_owned() {
            return Ok(slot);
        }
        let ahead = self.queued.fetch_add(1, Ordering::AcqRel);
        let _waiting = Waiting(&self.queued);
        if ahead >= self.max_queued {
            return Err(ApiError::Busy(format!(
                "every request slot is taken and {} requests wait already (http.max_concurrency, http.max_queued); retry later",
                self.max_queued
            )));
        }
        match tokio::time::timeout(self.queue_timeout, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(slot),
            Ok(Err(_)) => Err(ApiError::Unavailable("shutting down".into())),
            Err(_) => Err(ApiError::Busy(format!(
                "no request slot became free within http.queue_timeout ({:?}); retry later",
                self.queue_timeout
            ))),
        }
    }
}

fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The checks in the module docs, then the route, then the security headers.
pub(crate) async fn guard(State(st): State<AdminState>, req: Request, next: Next) -> Response {
    let mut resp = match admit_and_run(&st, req, next).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    };
    let h = resp.headers_mut();
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    resp
}

async fn admit_and_run(st: &AdminState, req: Request, next: Next) -> Result<Response, ApiError> {
    let inner = &st.0;
    inner.hosts.check_host(&req)?;
    if !is_safe(req.method()) {
        inner.hosts.check_origin(req.headers())?;
        match inner.token.as_deref() {
            None => check_simple_type(&req)?,
            Some(token) => {
                check_token(req.headers(), Some(token))?;
            }
        }
    }
    let _slot = inner.admission.admit().await?;
    let limit = inner.http.request_timeout;
    tokio::time::timeout(limit, next.run(req))
        .await
        .map_err(|_| ApiError::TimedOut(limit))
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]
    use super::*;

    fn policy(bind: &str, allowed: &[&str]) -> HostPolicy {
        HostPolicy::new(&HttpConfig {
            bind: bind.parse().unwrap(),
            allowed_hosts: allowed.iter().map(|s| s.to_string()).collect(),
            ..HttpConfig::default()
        })
    }

    #[test]
    fn loopback_bind_allows_loopback_names_only() {
        let p = policy("127.0.0.1:8080", &[]);
        for ok in [
            "localhost",
            "LOCALHOST.",
            "127.0.0.1",
            "[::1]",
            "::1",
            "127.0.0.2",
        ] {
            assert!(p.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example",
            "localhost.evil.example",
            "10.0.0.1",
            "0.0.0.0",
        ] {
            assert!(!p.allows(bad), "{bad}");
        }
    }

    #[test]
    fn configured_names_are_allowed() {
        let p = policy("10.0.0.5:8080", &["Dedupd.Internal"]);
        assert!(p.allows("dedupd.internal"));
        assert!(p.allows("10.0.0.5"));
        assert!(!p.allows("localhost"), "not a loopback bind");
        assert!(!p.allows("10.0.0.6"));
    }

    #[test]
    fn unspecified_bind_allows_ip_literals_and_localhost() {
        let p = policy("0.0.0.0:8080", &[]);
        assert!(p.allows("192.168.1.7"));
        assert!(p.allows("localhost"));
        assert!(!p.allows("evil.example"));
    }

    #[test]
    fn host_of_strips_the_port() {
        assert_eq!(HostPolicy::host_of("localhost:8080").unwrap(), "localhost");
        assert_eq!(HostPolicy::host_of("[::1]:8080").unwrap(), "[::1]");
        assert_eq!(HostPolicy::host_of("127.0.0.1").unwrap(), "127.0.0.1");
    }
}
