//! The stdin source (pipe mode): JSON lines in, one outcome line out per input line, in input order, each
//! printed only after its outcome is durable (G1).
//!
//! Memory is bounded by `[pipe]`: a line longer than `max_line_bytes` is skipped as it is
//! read (answered `rejected`), and at most `window` lines, of at most about
//! `max_bytes_in_flight` bytes together, are read but not yet printed. The reader takes a
//! credit per line and its bytes from a byte budget; the printer returns both once the
//! line is printed, so a head line that waits (a handler retry) stops the reading of stdin
//! instead of letting lines pile up behind it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Condvar, Mutex};

use crossbeam_channel::{bounded, select, unbounded, Receiver};
use serde::Serialize;

use crate::config::Config;
use crate::ledger::{Done, Job, Ledger, LedgerError, Outcome};
use crate::source::delivery::{route, Keying, RouteError, Routed, Target};
use crate::source::pipe_line::PipeLine;

use crate::pipeline::Sequencer;

/// Jobs per submission to one shard.
const CHUNK: usize = 512;

/// Why pipe mode stopped early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipeError {
    #[error("reading input failed: {0}")]
    Input(std::io::Error),
    #[error("writing outcomes failed: {0}")]
    Output(std::io::Error),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// Counts of the outcomes printed.
#[derive(Debug, Default, Clone, Serialize, PartialEq, Eq)]
pub struct PipeSummary {
    pub(crate) lines: u64,
    pub(crate) processed: u64,
    pub(crate) duplicate: u64,
    pub(crate) quarantined: u64,
    pub(crate) dead_lettered: u64,
    pub(crate) rejected: u64,
}

#[derive(Serialize)]
struct OutcomeLine<'a> {
    seq: u64,
    subscriber: Option<&'a str>,
    /// The line's `id` field as sent (`null` when it had none or did not parse).
    id: Option<&'a str>,
    /// The idempotency key the claim is under, as the subscriber's key source derived it
    /// (`null` when the line was rejected before it had one).
    key: Option<&'a str>,
    outcome: &'a str,
    reason: Option<String>,
}

/// What the printer needs to know of a line besides its outcome.
struct LineMeta {
    subscriber: Option<Arc<str>>,
    id: Option<String>,
    key: Option<String>,
    /// Bytes of the budget the line holds until it is printed.
    bytes: usize,
}

/// Bytes of lines read but not yet printed (`pipe.max_bytes_in_flight`). The reader waits
/// while the budget is used up; the printer gives a line's bytes back once it printed it,
/// and closes the budget when it stops, so a reader never waits for a printer that is gone.
#[derive(Debug)]
struct ByteBudget {
    limit: usize,
    state: Mutex<(usize, bool)>,
    freed: Condvar,
}

impl ByteBudget {
    fn new(limit: usize) -> ByteBudget {
        ByteBudget {
            limit,
            state: Mutex::new((0, false)),
            freed: Condvar::new(),
        }
    }

    fn exhausted(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0 >= self.limit
    }

    /// Waits until some of the budget is free; `false`: the printer stopped.
    fn wait_for_room(&self) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while st.0 >= self.limit && !st.1 {
            st = self.freed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        !st.1
    }

    fn take(&self, bytes: usize) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0 += bytes;
    }

    fn give(&self, bytes: usize) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.0 = st.0.saturating_sub(bytes);
        self.freed.notify_all();
    }

    fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.freed.notify_all();
    }
}

enum Event {
    Line(u64, LineMeta),
    Eof(u64),
}

/// Runs pipe mode until `input` ends and every outcome is printed, or until the ledger
/// fails (then the lines after the failure are never printed: nothing is acked on a guess).
pub fn run_pipe(
    ledger: &Ledger,
    config: &Config,
    input: impl Read,
    output: impl Write + Send,
) -> Result<PipeSummary, PipeError> {
    let input = BufReader::with_capacity(1 << 16, input);
    let (ack_tx, ack_rx) = unbounded::<Vec<Done>>();
    // Both unbounded channels carry at most `window` lines: one credit per line in flight.
    let (meta_tx, meta_rx) = unbounded::<Event>();
    let (credit_tx, credit_rx) = bounded::<()>(config.pipe.window.get());
    let budget = ByteBudget::new(config.pipe.max_bytes_in_flight.get());
    std::thread::scope(|scope| {
        let budget = &budget;
        let printer = scope.spawn(move || {
            let printed = print_outcomes(meta_rx, ack_rx, credit_rx, budget, output);
            budget.close();
            printed
        });
        let read_result = read_lines(ledger, config, input, &ack_tx, &meta_tx, &credit_tx, budget);
        drop(meta_tx);
        drop(ack_tx);
        drop(credit_tx);
        let printed = printer
            .join()
            .unwrap_or_else(|_| Err(PipeError::Output(std::io::Error::other("printer panicked"))));
        read_result?;
        printed
    })
}

fn read_lines<R: Read>(
    ledger: &Ledger,
    config: &Config,
    mut input: BufReader<R>,
    ack: &crossbeam_channel::Sender<Vec<Done>>,
    meta: &crossbeam_channel::Sender<Event>,
    credits: &crossbeam_channel::Sender<()>,
    budget: &ByteBudget,
) -> Result<(), PipeError> {
    let max_line = config.pipe.max_line_bytes.get();
    let mut staged: Vec<Vec<Job>> = (0..ledger.shard_count()).map(|_| Vec::new()).collect();
    let mut line = Vec::new();
    let mut seq = 0u64;
    let flush = |staged: &mut Vec<Vec<Job>>| -> Result<(), PipeError> {
        for (shard, jobs) in staged.iter_mut().enumerate() {
            if !jobs.is_empty() {
                ledger.submit(shard, std::mem::take(jobs))?;
            }
        }
        Ok(())
    };
    loop {
        if credits.is_full() {
            // `window` lines wait to be printed: hand over what is staged (their outcomes
            // free the credits), then wait for a credit before reading on.
            flush(&mut staged)?;
        }
        if credits.send(()).is_err() {
            // The printer stopped (output failed or the ledger failed): stop reading.
            break;
        }
        if budget.exhausted() {
            // The bytes in flight are used up: the same, by size.
            flush(&mut staged)?;
            if !budget.wait_for_room() {
                break;
            }
        }
        let read = read_line_capped(&mut input, &mut line, max_line).map_err(PipeError::Input)?;
        if read == LineRead::Eof {
            break;
        }
        seq += 1;
        let decided = match read {
            LineRead::Eof | LineRead::Line => {
                decide_line(ledger, config, trim_line(&line), seq, ack)
            }
            LineRead::TooLong { bytes } => Err((
                LineMeta {
                    subscriber: None,
                    id: None,
                    key: None,
                    bytes: 0,
                },
                format!("line of {bytes} bytes is longer than pipe.max_line_bytes ({max_line})"),
            )),
        };
        let (mut m, job) = match decided {
            Ok((m, job)) => (m, Some(Ok(job))),
            Err((m, reason)) => (m, Some(Err(reason))),
        };
        // What the line keeps in memory until it is printed: its job holds the payload.
        if matches!(job, Some(Ok(_))) {
            m.bytes = line.len();
            budget.take(m.bytes);
        }
        if meta.send(Event::Line(seq, m)).is_err() {
            // The printer stopped (output failed or the ledger failed): stop reading.
            break;
        }
        let job = match job {
            Some(Err(reason)) => {
                let _ = ack.send(vec![Done {
                    seq,
                    outcome: Outcome::Rejected { reason },
                }]);
                None
            }
            Some(Ok(j)) => Some(j),
            None => None,
        };
        if let Some(Routed { job, shard, .. }) = job {
            staged[shard].push(job);
            if staged[shard].len() >= CHUNK {
                ledger.submit(shard, std::mem::take(&mut staged[shard]))?;
            }
        }
        // Nothing more buffered: the next read may block, so hand over what we have
        // (a consumer that waits for each outcome before sending more must get it).
        if input.buffer().is_empty() {
            flush(&mut staged)?;
        }
    }
    flush(&mut staged)?;
    let _ = meta.send(Event::Eof(seq));
    Ok(())
}

/// What [`read_line_capped`] found.
#[derive(Debug, PartialEq, Eq)]
enum LineRead {
    Eof,
    /// `line` holds the line (with its ending, if it had one).
    Line,
    /// The line was longer than the cap and was skipped; `bytes` without its `\n`.
    TooLong {
        bytes: u64,
    },
}

/// Reads one line into `line`, keeping at most `max` bytes of content (plus a `\r\n`): a
/// longer line is consumed to its end without being kept.
fn read_line_capped(
    input: &mut impl BufRead,
    line: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<LineRead> {
    line.clear();
    let mut total = 0u64;
    let mut read_any = false;
    let mut too_long = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            break;
        }
        read_any = true;
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if !too_long && line.len() + take <= max + 2 {
            line.extend_from_slice(&buf[..take]);
        } else if !too_long {
            too_long = true;
            line.clear();
        }
        input.consume(take);
        if done {
            total += take as u64 - 1;
            break;
        }
        total += take as u64;
    }
    if !read_any {
        return Ok(LineRead::Eof);
    }
    if too_long || trim_line(line).len() > max {
        return Ok(LineRead::TooLong { bytes: total });
    }
    Ok(LineRead::Line)
}

fn trim_line(line: &[u8]) -> &[u8] {
    let mut end = line.len();
    while end > 0 && (line[end - 1] == b'\n' || line[end - 1] == b'\r') {
        end -= 1;
    }
    &line[..end]
}

/// Parses one line into a job, or says why it is rejected.
#[allow(
    clippy::result_large_err,
    reason = "the rejection carries the line back; one per line, not worth a box"
)]
fn decide_line(
    ledger: &Ledger,
    config: &Config,
    text: &[u8],
    seq: u64,
    ack: &crossbeam_channel::Sender<Vec<Done>>,
) -> Result<(LineMeta, Routed), (LineMeta, String)> {
    let none = || LineMeta {
        subscriber: None,
        id: None,
        key: None,
        bytes: 0,
    };
    if text.iter().all(|b| b.is_ascii_whitespace()) {
        return Err((none(), "empty line".into()));
    }
    let mut line: PipeLine = match serde_json::from_slice(text) {
        Ok(l) => l,
        Err(e) => return Err((none(), format!("malformed JSON: {e}"))),
    };
    let sub_name = line
        .subscriber
        .take()
        .unwrap_or_else(|| config.default_subscriber.clone());
    let id = line.id.clone();
    let delivery = line.into_delivery(Target::Name(sub_name));
    match route(ledger, delivery, Keying::Derive, ack.clone()) {
        Ok(mut routed) => {
            routed.job.seq = seq;
            let meta = LineMeta {
                subscriber: Some(routed.sub.name.clone()),
                id,
                key: Some(routed.job.id.to_string()),
                bytes: 0,
            };
            Ok((meta, routed))
        }
        Err(RouteError::Subscriber(e)) => Err((
            LineMeta {
                subscriber: None,
                id,
                key: None,
                bytes: 0,
            },
            e.to_string(),
        )),
        Err(RouteError::Key { subscriber, error }) => Err((
            LineMeta {
                subscriber: Some(subscriber),
                // Never echo a huge id back; the reason already says how long it was.
                id: id.map(|s| s.chars().take(128).collect::<String>()),
                key: None,
                bytes: 0,
            },
            error.to_string(),
        )),
        Err(RouteError::Entity {
            subscriber,
            key,
            error,
        }) => Err((
            LineMeta {
                subscriber: Some(subscriber),
                id,
                key: Some(key.text),
                bytes: 0,
            },
            error.to_string(),
        )),
    }
}

fn print_outcomes(
    meta_rx: Receiver<Event>,
    ack_rx: Receiver<Vec<Done>>,
    credits: Receiver<()>,
    budget: &ByteBudget,
    output: impl Write,
) -> Result<PipeSummary, PipeError> {
    let mut out = std::io::BufWriter::with_capacity(1 << 16, output);
    let mut metas: HashMap<u64, LineMeta> = HashMap::new();
    let mut order: Sequencer<Outcome> = Sequencer::starting_at(1);
    let mut total: Option<u64> = None;
    let mut summary = PipeSummary::default();
    let mut buf = Vec::with_capacity(256);
    // A closed channel is swapped for one that never delivers, so `select!` keeps serving
    // the other until both are done.
    let (mut meta_rx, mut ack_rx) = (meta_rx, ack_rx);
    let (mut meta_open, mut ack_open) = (true, true);
    loop {
        if total == Some(order.watermark() - 1) || (!meta_open && !ack_open) {
            break;
        }
        select! {
            recv(meta_rx) -> ev => match ev {
                Ok(Event::Line(seq, m)) => { metas.insert(seq, m); }
                Ok(Event::Eof(n)) => total = Some(n),
                Err(_) => { meta_open = false; meta_rx = crossbeam_channel::never(); }
            },
            recv(ack_rx) -> done => match done {
                Ok(v) => for d in v { order.insert(d.seq, d.outcome); },
                Err(_) => { ack_open = false; ack_rx = crossbeam_channel::never(); }
            },
        }
        // A line is printed once both its outcome and what it names have arrived.
        while order
            .next_ready()
            .is_some_and(|seq| metas.contains_key(&seq))
        {
            let Some((seq, outcome)) = order.pop_ready() else {
                break;
            };
            if let Outcome::Failed { reason } = &outcome {
                out.flush().map_err(PipeError::Output)?;
                return Err(PipeError::Ledger(LedgerError::Poisoned(reason.clone())));
            }
            let m = metas.remove(&seq).unwrap_or(LineMeta {
                subscriber: None,
                id: None,
                key: None,
                bytes: 0,
            });
            match &outcome {
                Outcome::Processed => summary.processed += 1,
                Outcome::Duplicate => summary.duplicate += 1,
                Outcome::Quarantined { .. } => summary.quarantined += 1,
                Outcome::DeadLettered { .. } => summary.dead_lettered += 1,
                Outcome::Rejected { .. } | Outcome::Failed { .. } => summary.rejected += 1,
            }
            summary.lines += 1;
            buf.clear();
            let line = OutcomeLine {
                seq,
                subscriber: m.subscriber.as_deref(),
                id: m.id.as_deref(),
                key: m.key.as_deref(),
                outcome: outcome.name(),
                reason: outcome.reason(),
            };
            serde_json::to_writer(&mut buf, &line)
                .map_err(|e| PipeError::Output(std::io::Error::other(e)))?;
            buf.push(b'\n');
            out.write_all(&buf).map_err(PipeError::Output)?;
            // The line is out of the window: the reader may read one more.
            let _ = credits.try_recv();
            budget.give(m.bytes);
        }
        if ack_rx.is_empty() {
            out.flush().map_err(PipeError::Output)?;
        }
    }
    out.flush().map_err(PipeError::Output)?;
    if total != Some(order.watermark() - 1) {
        // Every channel closed with lines undecided: a shard writer is gone (G7). The
        // lines that were printed are durable; the rest must not read as a clean end.
        return Err(PipeError::Ledger(LedgerError::Poisoned(format!(
            "no outcome arrived for line {} and later ones: a shard writer stopped",
            order.watermark()
        ))));
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::clock::SystemClock;
    use crate::effects::StateReader;
    use crate::effects::{Effects, Failure, HandlerFactory, HandlerMessage, MessageHandler};

    fn capped(input: &[u8], max: usize) -> Vec<(LineRead, Vec<u8>)> {
        let mut r = BufReader::with_capacity(4, input);
        let mut line = Vec::new();
        let mut out = Vec::new();
        loop {
            let got = read_line_capped(&mut r, &mut line, max).unwrap();
            if got == LineRead::Eof {
                return out;
            }
            out.push((got, trim_line(&line).to_vec()));
        }
    }

    #[test]
    fn line_cap_obeyed() {
        let got = capped(b"12345678\r\n\n1234", 8);
        assert_eq!(
            got,
            vec![
                (LineRead::Line, b"12345678".to_vec()),
                (LineRead::Line, Vec::new()),
                (LineRead::Line, b"1234".to_vec()),
            ]
        );
    }

    #[test]
    fn line_cap_violated() {
        let got = capped(b"123456789\nok\n12345678901234567890", 8);
        assert_eq!(got[0].0, LineRead::TooLong { bytes: 9 });
        assert_eq!(got[1], (LineRead::Line, b"ok".to_vec()));
        assert_eq!(got[2].0, LineRead::TooLong { bytes: 20 });
        assert_eq!(got.len(), 3);
    }

    /// Fails message `m-1` (retryably) until `release` is set; succeeds on everything else.
    #[derive(Debug)]
    struct HeadBlocker {
        release: Arc<AtomicBool>,
        head_done: Arc<AtomicBool>,
    }

    impl MessageHandler for HeadBlocker {
        fn handle(
            &mut self,
            msg: &HandlerMessage,
            state: Box<dyn StateReader>,
        ) -> (Box<dyn StateReader>, Result<Effects, Failure>) {
            if msg.id == "m-1" {
                if !self.release.load(Ordering::SeqCst) {
                    return (state, Err(Failure::Retryable("not yet".into())));
                }
                self.head_done.store(true, Ordering::SeqCst);
            }
            (state, Ok(Effects::default()))
        }
    }

    impl HandlerFactory for HeadBlocker {
        fn instantiate(&self) -> Result<Box<dyn MessageHandler>, String> {
            Ok(Box::new(HeadBlocker {
                release: self.release.clone(),
                head_done: self.head_done.clone(),
            }))
        }
        fn version(&self) -> u64 {
            1
        }
    }

    /// Hands out one input line per `read`, and notes every line handed out beyond the
    /// window while the head line was still undecided. Releases the head when the last
    /// line the window allows is handed out.
    struct Lines {
        handed: u64,
        total: u64,
        window: u64,
        release: Arc<AtomicBool>,
        head_done: Arc<AtomicBool>,
        read_past_window: Arc<AtomicU64>,
    }

    impl Read for Lines {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.handed == self.total {
                return Ok(0);
            }
            self.handed += 1;
            let n = self.handed;
            if n > self.window && !self.head_done.load(Ordering::SeqCst) {
                self.read_past_window.fetch_add(1, Ordering::SeqCst);
            }
            if n == self.window {
                self.release.store(true, Ordering::SeqCst);
            }
            let line = format!("{{\"id\":\"m-{n}\",\"payload\":{{}}}}\n");
            buf[..line.len()].copy_from_slice(line.as_bytes());
            Ok(line.len())
        }
    }

    #[test]
    fn reader_stops_at_the_window_while_the_head_line_is_retried() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.ledger.shards = std::num::NonZeroUsize::new(1);
        config.defaults.max_attempts = 100;
        // Long enough that an unbounded reader runs far ahead while the head waits.
        config.defaults.retry_backoff = Duration::from_millis(20);
        config.pipe.window = std::num::NonZeroUsize::new(8).unwrap();
        let ledger = Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap();
        let release = Arc::new(AtomicBool::new(false));
        let head_done = Arc::new(AtomicBool::new(false));
        ledger
            .set_handler(
                "default",
                Some(Arc::new(HeadBlocker {
                    release: release.clone(),
                    head_done: head_done.clone(),
                })),
            )
            .unwrap();
        let read_past_window = Arc::new(AtomicU64::new(0));
        let input = Lines {
            handed: 0,
            total: 40,
            window: 8,
            release,
            head_done: head_done.clone(),
            read_past_window: read_past_window.clone(),
        };
        let mut out = Vec::new();
        let summary = run_pipe(&ledger, &config, input, &mut out).unwrap();
        assert_eq!(summary.processed, 40, "{}", String::from_utf8_lossy(&out));
        assert!(head_done.load(Ordering::SeqCst));
        assert_eq!(
            read_past_window.load(Ordering::SeqCst),
            0,
            "lines read beyond the window of 8 while line 1 waited for its retry"
        );
    }

    /// The pair of the test above by size: a window of 1,000 lines, but a byte budget of
    /// about eight lines, so reading pauses after eight while the head line waits.
    #[test]
    fn reader_stops_at_the_byte_budget_while_the_head_line_is_retried() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.ledger.shards = std::num::NonZeroUsize::new(1);
        config.defaults.max_attempts = 100;
        config.defaults.retry_backoff = Duration::from_millis(20);
        config.pipe.window = std::num::NonZeroUsize::new(1_000).unwrap();
        // Lines are 27 bytes: seven hold 189, the eighth reaches 216.
        config.pipe.max_bytes_in_flight = std::num::NonZeroUsize::new(200).unwrap();
        let ledger = Ledger::open(dir.path(), &config, Arc::new(SystemClock)).unwrap();
        let release = Arc::new(AtomicBool::new(false));
        let head_done = Arc::new(AtomicBool::new(false));
        ledger
            .set_handler(
                "default",
                Some(Arc::new(HeadBlocker {
                    release: release.clone(),
                    head_done: head_done.clone(),
                })),
            )
            .unwrap();
        let read_past_budget = Arc::new(AtomicU64::new(0));
        let input = Lines {
            handed: 0,
            total: 40,
            window: 8,
            release,
            head_done: head_done.clone(),
            read_past_window: read_past_budget.clone(),
        };
        let mut out = Vec::new();
        let summary = run_pipe(&ledger, &config, input, &mut out).unwrap();
        assert_eq!(summary.processed, 40, "{}", String::from_utf8_lossy(&out));
        assert!(head_done.load(Ordering::SeqCst));
        assert_eq!(
            read_past_budget.load(Ordering::SeqCst),
            0,
            "lines read beyond the byte budget while line 1 waited for its retry"
        );
    }
}
