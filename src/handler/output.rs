//! Guest stdout/stderr: captured per call and written to the engine's log, rate-limited so
//! a chatty or hostile handler cannot flood it. The same budget (20 lines per second per
//! instance) admits the lines of the `log` host import: capped per call alone, a handler
//! logging 20 lines per message at 10,000 messages per second wrote 200,000 lines per
//! second (measured with `fixture-log-flood` in `tests/adversarial.rs`).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Bytes kept per call; the rest is counted and dropped.
const CALL_CAP: usize = 16 * 1024;
/// Lines per second per instance that reach the log (printed and `log` lines together).
const LINES_PER_SEC: f64 = 20.0;
/// At most one "output dropped" notice per instance in this long.
const NOTICE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

struct Inner {
    buf: Vec<u8>,
    dropped_bytes: u64,
    tokens: f64,
    refilled: Instant,
    suppressed_lines: u64,
    last_notice: Option<Instant>,
}

impl Inner {
    fn refill(&mut self) {
        let now = Instant::now();
        let elapsed = now.duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * LINES_PER_SEC).min(LINES_PER_SEC);
        self.refilled = now;
    }

    /// Takes one line's token; a line without one is counted as suppressed.
    fn admit(&mut self) -> bool {
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return true;
        }
        self.suppressed_lines += 1;
        false
    }
}

/// Shared by the stdout and stderr of one instance.
#[derive(Clone)]
pub(crate) struct GuestOutput {
    name: Arc<str>,
    inner: Arc<Mutex<Inner>>,
}

impl GuestOutput {
    pub(crate) fn new(name: String) -> Self {
        GuestOutput {
            name: name.into(),
            inner: Arc::new(Mutex::new(Inner {
                buf: Vec::new(),
                dropped_bytes: 0,
                tokens: LINES_PER_SEC,
                refilled: Instant::now(),
                suppressed_lines: 0,
                last_notice: None,
            })),
        }
    }

    fn append(&self, bytes: &[u8]) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let room = CALL_CAP.saturating_sub(g.buf.len());
        let take = room.min(bytes.len());
        g.buf.extend_from_slice(&bytes[..take]);
        g.dropped_bytes += (bytes.len() - take) as u64;
    }

    /// Takes what the last call printed, as its non-blank lines, instead of logging it
    /// (`dedupd handler test`). The per-call cap applies as it does for the log; a line
    /// says how many bytes over it were dropped. No rate limit: it depends on the time.
    pub(crate) fn take_lines(&self) -> Vec<String> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let text = String::from_utf8_lossy(&std::mem::take(&mut g.buf)).into_owned();
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        let dropped = std::mem::take(&mut g.dropped_bytes);
        if dropped > 0 {
            lines.push(format!(
                "({dropped} bytes of output over the {CALL_CAP}-byte limit per call were dropped)"
            ));
        }
        lines
    }

    /// Whether one line of the `log` host import may reach the log now: it takes a token
    /// of the same budget as printed lines; a refused line is counted in the next notice.
    pub(crate) fn admit_log_line(&self) -> bool {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.refill();
        g.admit()
    }

    /// Writes what the last call printed to the log, within the rate limit, and at most
    /// once a second a notice of what was dropped since the last one.
    pub(crate) fn flush_to_log(&self, subscriber: &str) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if g.buf.is_empty() && g.dropped_bytes == 0 && g.suppressed_lines == 0 {
            return;
        }
        g.refill();
        let text = String::from_utf8_lossy(&std::mem::take(&mut g.buf)).into_owned();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            if g.admit() {
                tracing::info!(subscriber, handler = %self.name, "guest: {line}");
            }
        }
        let now = Instant::now();
        let due = g
            .last_notice
            .is_none_or(|t| now.duration_since(t) >= NOTICE_EVERY);
        if (g.dropped_bytes > 0 || g.suppressed_lines > 0) && due {
            tracing::warn!(subscriber, handler = %self.name, dropped_bytes = g.dropped_bytes,
                suppressed_lines = g.suppressed_lines, "guest output over its limits was dropped");
            g.dropped_bytes = 0;
            g.suppressed_lines = 0;
            g.last_notice = Some(now);
        }
    }
}

impl IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestOutput {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for GuestOutput {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.append(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        // Always accept: what exceeds the per-call cap is counted and dropped.
        Ok(CALL_CAP)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for GuestOutput {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for GuestOutput {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.append(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
