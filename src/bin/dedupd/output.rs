//! Where the binary writes for people: logs on stderr (text or JSON lines, colour only at
//! a terminal) and progress lines.

use std::io::{IsTerminal, Write};

use crate::args::{Command, LogFormat};

/// Logs to stderr, as text or JSON lines, at `RUST_LOG`'s levels or the command's default:
/// the long-running commands say what they do at `info`, the others only what went wrong.
pub fn init_logs(format: LogFormat, command: &Command) {
    let default = match command {
        Command::Run { .. } | Command::Serve { .. } => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour only for a person at a terminal: a log file or journald gets plain text.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let logs = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_env_filter(filter);
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().flatten_event(true).init(),
    }
}

/// A progress line: rewritten in place on a terminal; elsewhere (a log file, journald, a
/// pipe) a plain line at most every [`PROGRESS_EVERY`], so `\r` updates never pile onto one
/// line of a log.
pub fn progress(line: &dyn std::fmt::Display) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut err = std::io::stderr().lock();
    if err.is_terminal() {
        let _ = write!(err, "\r{line}   ");
        let _ = err.flush();
        return;
    }
    let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
        *last = Some(std::time::Instant::now());
        let _ = writeln!(err, "{line}");
    }
}

/// How often progress is printed when stderr is not a terminal.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Ends a progress line on a terminal (elsewhere every progress line is whole already).
pub fn end_progress() {
    if std::io::stderr().is_terminal() {
        eprintln!();
    }
}
