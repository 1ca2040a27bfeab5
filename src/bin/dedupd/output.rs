//! Where the binary writes for people: logs on stderr (text or JSON lines, colour only at
//! a terminal), progress lines, and progress bars for copies (indicatif, at a terminal).

use std::io::{IsTerminal, Write};

use crate::args::{Command, LogFormat};

/// Logs to stderr, as text or JSON lines, at `RUST_LOG`'s levels or the command's default:
/// the long-running commands say what they do at `info`, the others only what went wrong.
pub(crate) fn init_logs(format: LogFormat, command: &Command) {
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
pub(crate) fn progress(line: &dyn std::fmt::Display) {
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
pub(crate) const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Ends a progress line on a terminal (elsewhere every progress line is whole already).
pub(crate) fn end_progress() {
    if std::io::stderr().is_terminal() {
        eprintln!();
    }
}

/// An observer of a backup, a restore or a check ([`dedupd::backup::Progress`]): a bar per
/// step at a terminal (bytes, rate, time left); elsewhere a plain line per step and at most
/// every [`PROGRESS_EVERY`] while it lasts, then one when it ends.
pub(crate) struct CopyProgress {
    bar: Option<indicatif::ProgressBar>,
    step: &'static str,
    done: u64,
    total: u64,
    last: std::time::Instant,
}

impl CopyProgress {
    pub(crate) fn new() -> CopyProgress {
        CopyProgress {
            bar: None,
            step: "",
            done: 0,
            total: 0,
            last: std::time::Instant::now(),
        }
    }

    pub(crate) fn observe(&mut self, p: dedupd::backup::Progress) {
        use dedupd::backup::Progress;
        match p {
            Progress::Step { what, bytes } => {
                self.finish_step();
                self.step = what;
                self.done = 0;
                self.total = bytes;
                self.last = std::time::Instant::now();
                if std::io::stderr().is_terminal() {
                    let bar = indicatif::ProgressBar::new(bytes).with_message(what);
                    bar.set_style(
                        indicatif::ProgressStyle::with_template(
                            "{msg:22} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                        )
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                    self.bar = Some(bar);
                } else {
                    eprintln!("{what}: {bytes} bytes");
                }
            }
            Progress::Read(n) => {
                self.done += n;
                match &self.bar {
                    Some(bar) => bar.inc(n),
                    None if self.last.elapsed() >= PROGRESS_EVERY => {
                        self.last = std::time::Instant::now();
                        eprintln!("{}: {} of {} bytes", self.step, self.done, self.total);
                    }
                    None => {}
                }
            }
            _ => {}
        }
    }

    fn finish_step(&mut self) {
        match self.bar.take() {
            Some(bar) => bar.finish(),
            None if !self.step.is_empty() => {
                eprintln!("{}: done, {} bytes", self.step, self.done)
            }
            None => {}
        }
        self.step = "";
    }
}

impl Drop for CopyProgress {
    fn drop(&mut self) {
        // A bar left as it stood when the copy failed; a step that ended is said to.
        if let Some(bar) = self.bar.take() {
            bar.abandon();
        } else {
            self.finish_step();
        }
    }
}
