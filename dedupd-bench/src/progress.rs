//! What `compare` shows while it runs, the way `dedupd backup` and `restore` show their
//! copies (`src/bin/dedupd/output.rs`): at a terminal a bar per phase (messages, rate, time
//! left); elsewhere (a log file, CI, a pipe) a plain line when a phase starts, at most every
//! [`PROGRESS_EVERY`] while it lasts and one when it ends, so a log of a long comparison is
//! whole lines rather than one line of `\r` rewrites.

use std::io::Write;
use std::time::{Duration, Instant};

use dedupd::bench::Progress;

/// How often progress is printed when stderr is not a terminal.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// An observer of a comparison's phases ([`Progress`]); the plain lines go to `out`.
pub struct RunProgress<W: Write> {
    out: W,
    terminal: bool,
    bar: Option<indicatif::ProgressBar>,
    phase: &'static str,
    last: Instant,
}

impl RunProgress<std::io::Stderr> {
    /// On stderr, with bars when it is a terminal.
    pub fn stderr() -> Self {
        use std::io::IsTerminal;
        let err = std::io::stderr();
        let terminal = err.is_terminal();
        RunProgress::new(err, terminal)
    }
}

impl<W: Write> RunProgress<W> {
    pub fn new(out: W, terminal: bool) -> Self {
        RunProgress {
            out,
            terminal,
            bar: None,
            phase: "",
            last: Instant::now(),
        }
    }

    /// A system starts: the phase before it ends, and its name gets a line of its own.
    pub fn system(&mut self, name: &str) {
        self.finish_phase();
        let _ = writeln!(self.out, "== {name}");
    }

    pub fn observe(&mut self, p: &Progress) {
        if p.phase != self.phase {
            self.finish_phase();
            self.phase = p.phase;
            self.last = Instant::now();
            if self.terminal {
                let bar = indicatif::ProgressBar::new(p.total).with_message(p.phase);
                bar.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{msg:8} [{bar:30}] {pos}/{len} msgs {per_sec} eta {eta}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                    .progress_chars("=> "),
                );
                self.bar = Some(bar);
            } else {
                let _ = writeln!(self.out, "{}: {} msgs", p.phase, p.total);
            }
        }
        match &self.bar {
            Some(bar) => {
                bar.set_length(p.total);
                bar.set_position(p.done);
            }
            None if self.last.elapsed() >= PROGRESS_EVERY => {
                self.last = Instant::now();
                let _ = writeln!(self.out, "{}", p.to_string().trim_start());
            }
            None => {}
        }
    }

    fn finish_phase(&mut self) {
        match self.bar.take() {
            Some(bar) => bar.finish(),
            // No count: the engine reports at most once a second, so the last one seen
            // is not the phase's total.
            None if !self.phase.is_empty() => {
                let _ = writeln!(self.out, "{}: done", self.phase);
            }
            None => {}
        }
        self.phase = "";
    }
}

impl<W: Write> Drop for RunProgress<W> {
    fn drop(&mut self) {
        // A bar left as it stood when the run failed; a phase that ended is said to.
        match self.bar.take() {
            Some(bar) => bar.abandon(),
            None => self.finish_phase(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(phase: &'static str, done: u64) -> Progress {
        Progress {
            phase,
            done,
            total: 1_000,
            elapsed: Duration::from_secs(1),
            p99_ms: 1.0,
        }
    }

    /// Not at a terminal: whole lines only, one when a phase starts and one when it ends,
    /// and none for updates within [`PROGRESS_EVERY`] of the last line.
    #[test]
    fn without_a_terminal_phases_are_plain_lines_without_carriage_returns() {
        let mut out = Vec::new();
        {
            let mut shown = RunProgress::new(&mut out, false);
            shown.system("dedupd_claim");
            shown.observe(&at("run", 100));
            shown.observe(&at("run", 500));
            shown.system("naive_redb");
            shown.observe(&at("naive", 300));
        }
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains('\r'), "{text:?}");
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            [
                "== dedupd_claim",
                "run: 1000 msgs",
                "run: done",
                "== naive_redb",
                "naive: 1000 msgs",
                "naive: done",
            ],
            "{text:?}"
        );
    }

    /// A long phase prints its progress again after [`PROGRESS_EVERY`].
    #[test]
    fn without_a_terminal_a_long_phase_repeats_its_line() {
        let mut out = Vec::new();
        {
            let mut shown = RunProgress::new(&mut out, false);
            shown.observe(&at("run", 100));
            shown.last -= PROGRESS_EVERY;
            shown.observe(&at("run", 600));
        }
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text:?}");
        assert!(lines[1].starts_with("run  60.0%"), "{text:?}");
        assert_eq!(lines[2], "run: done");
    }
}
