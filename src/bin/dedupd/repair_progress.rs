//! What `dedupd inspect --repair` shows while the engine opens the directory: the shards
//! open in parallel, each on its own thread, and tell [`RepairProgress`] their steps
//! ([`dedupd::ledger::OpenProgress`]). At a terminal a bar of the shards opened, its
//! message the latest step; elsewhere (a log file, a pipe) whole lines on stderr: when a
//! shard's file needs redb's repair, when each shard is open, and at most every
//! [`PROGRESS_EVERY`] the step under way. Never anything on stdout, which carries the
//! report (`--json`).

use std::io::IsTerminal;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dedupd::ledger::{OpenObserver, OpenProgress};

use crate::output::PROGRESS_EVERY;

/// The observer of one repairing open.
pub(crate) struct RepairProgress {
    state: Mutex<State>,
}

struct State {
    bar: Option<indicatif::ProgressBar>,
    /// Lines instead of a bar.
    plain: bool,
    dir: String,
    shards: usize,
    opened: usize,
    started: Instant,
    /// When the last rate-limited line was printed.
    last: Instant,
}

impl RepairProgress {
    pub(crate) fn new(dir: &Path) -> Arc<RepairProgress> {
        Arc::new(RepairProgress {
            state: Mutex::new(State {
                bar: None,
                plain: !std::io::stderr().is_terminal(),
                dir: dir.display().to_string(),
                shards: 0,
                opened: 0,
                started: Instant::now(),
                last: Instant::now(),
            }),
        })
    }

    /// The observer to open the ledger with.
    pub(crate) fn observer(self: &Arc<Self>) -> OpenObserver {
        let this = self.clone();
        Arc::new(move |step| this.observe(step))
    }

    fn observe(&self, step: OpenProgress) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.observe(step);
    }

    /// Ends the display once the open is over (opened or failed).
    pub(crate) fn finish(&self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let secs = st.started.elapsed().as_secs_f64();
        match st.bar.take() {
            Some(bar) if st.opened == st.shards => bar.finish(),
            Some(bar) => bar.abandon(),
            None if st.plain && st.shards > 0 && st.opened == st.shards => {
                eprintln!("repair: {} shards open in {secs:.1} s", st.shards)
            }
            None => {}
        }
    }
}

impl State {
    fn observe(&mut self, step: OpenProgress) {
        match step {
            OpenProgress::Opening { shard, of } => {
                if self.shards == 0 {
                    self.start(of);
                }
                self.update(false, || format!("shard {shard}: opening"));
            }
            OpenProgress::Repairing { shard, fraction } => {
                // The start of a repair is always said: it is why this open takes long.
                let first = fraction == 0.0;
                self.update(first, || match first {
                    true => format!(
                        "shard {shard}: not closed cleanly, redb repairs the file (scans it 3 times)"
                    ),
                    false => format!("shard {shard}: redb repair {:.0}%", fraction * 100.0),
                });
            }
            OpenProgress::Loaded {
                shard,
                subscriber,
                generations,
            } => self.update(false, || {
                format!("shard {shard}: {subscriber}: {generations} sealed generations loaded")
            }),
            OpenProgress::Replaying {
                shard,
                subscriber,
                rows,
            } => self.update(false, || {
                format!("shard {shard}: {subscriber}: {rows} log rows replayed")
            }),
            OpenProgress::Opened { shard } => {
                self.opened += 1;
                if let Some(bar) = &self.bar {
                    bar.inc(1);
                }
                let (opened, shards) = (self.opened, self.shards);
                let secs = self.started.elapsed().as_secs_f64();
                self.update(true, || {
                    format!("shard {shard} open ({opened} of {shards}, {secs:.1} s)")
                });
            }
            _ => {}
        }
    }

    fn start(&mut self, shards: usize) {
        self.shards = shards;
        if self.plain {
            eprintln!("repair: opening {shards} shard files of {}", self.dir);
            self.last = Instant::now();
            return;
        }
        let bar = indicatif::ProgressBar::new(shards as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "repair [{bar:30}] {pos}/{len} shards open {elapsed} {wide_msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        // redb's scans of a large file are silent for a while: keep the clock moving.
        bar.enable_steady_tick(std::time::Duration::from_millis(250));
        self.bar = Some(bar);
    }

    /// Shows the step: as the bar's message, or as a line if `always` or none was printed
    /// for [`PROGRESS_EVERY`].
    fn update(&mut self, always: bool, line: impl FnOnce() -> String) {
        if let Some(bar) = &self.bar {
            bar.set_message(line());
        } else if self.plain && (always || self.last.elapsed() >= PROGRESS_EVERY) {
            self.last = Instant::now();
            eprintln!("repair: {}", line());
        }
    }
}
