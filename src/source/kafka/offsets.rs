//! Per-partition offset watermark (G1): an offset may be stored only when every message
//! before it in the partition has a durable outcome.
//!
//! Kafka offsets are not contiguous (compaction, transaction markers), so messages are
//! numbered locally in arrival order and the [`Sequencer`] releases those numbers; the
//! tracker maps them back to offsets.

use std::collections::VecDeque;

use crate::pipeline::Sequencer;

/// One received message of a partition: its offset, its produce timestamp (ms), and what
/// the source kept of it (the record, when it may still go to the dead-letter topic).
#[derive(Debug)]
struct Entry<R> {
    offset: i64,
    timestamp_ms: i64,
    retained: Option<R>,
}

/// The in-flight messages of one partition, oldest first.
#[derive(Debug)]
pub(crate) struct OffsetTracker<R> {
    order: Sequencer<()>,
    entries: VecDeque<Entry<R>>,
    /// Local number of `entries[0]`.
    base: u64,
    next_local: u64,
}

impl<R> Default for OffsetTracker<R> {
    fn default() -> Self {
        OffsetTracker {
            order: Sequencer::starting_at(0),
            entries: VecDeque::new(),
            base: 0,
            next_local: 0,
        }
    }
}

/// What a watermark advance released.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Released {
    /// The offset to store: one past the last released message.
    pub(crate) store: Option<i64>,
    /// Messages released.
    pub(crate) count: u64,
    /// Produce timestamps (ms) of the released messages.
    pub(crate) timestamps_ms: Vec<i64>,
}

impl<R> OffsetTracker<R> {
    /// Records a received message; returns its local number.
    pub(crate) fn push(&mut self, offset: i64, timestamp_ms: i64, retained: Option<R>) -> u64 {
        let local = self.next_local;
        self.next_local += 1;
        self.entries.push_back(Entry {
            offset,
            timestamp_ms,
            retained,
        });
        local
    }

    /// The local number the next message will get.
    pub(crate) fn next_local(&self) -> u64 {
        self.next_local
    }

    /// Messages released so far: every local number below it has a durable outcome.
    pub(crate) fn released(&self) -> u64 {
        self.base
    }

    /// Takes what was retained of a message still in flight.
    pub(crate) fn take_retained(&mut self, local: u64) -> Option<R> {
        let at = local.checked_sub(self.base)? as usize;
        self.entries.get_mut(at)?.retained.take()
    }

    /// Puts back a retained record (a dead-letter produce that must be tried again).
    pub(crate) fn put_retained(&mut self, local: u64, r: R) {
        if let Some(e) = local
            .checked_sub(self.base)
            .and_then(|at| self.entries.get_mut(at as usize))
        {
            e.retained = Some(r);
        }
    }

    /// The offset of a message still in flight.
    pub(crate) fn offset_of(&self, local: u64) -> Option<i64> {
        let at = local.checked_sub(self.base)? as usize;
        self.entries.get(at).map(|e| e.offset)
    }

    /// Marks a message's outcome durable (and, for dead letters, delivered).
    pub(crate) fn resolve(&mut self, local: u64) {
        if local < self.next_local {
            self.order.insert(local, ());
        }
    }

    /// Releases the contiguous prefix of resolved messages.
    pub(crate) fn advance(&mut self, with_timestamps: bool) -> Released {
        let mut out = Released::default();
        while let Some((local, ())) = self.order.pop_ready() {
            debug_assert_eq!(local, self.base);
            let Some(e) = self.entries.pop_front() else {
                break;
            };
            self.base += 1;
            out.count += 1;
            out.store = Some(e.offset + 1);
            if with_timestamps {
                out.timestamps_ms.push(e.timestamp_ms);
            }
        }
        out
    }

    /// Messages received and not yet released.
    pub(crate) fn in_flight(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_waits_for_gap() {
        let mut t: OffsetTracker<()> = OffsetTracker::default();
        let a = t.push(10, 0, None);
        let b = t.push(11, 0, None);
        let c = t.push(15, 0, None); // offsets 12-14 compacted away
        t.resolve(c);
        t.resolve(b);
        assert_eq!(t.advance(false).store, None, "offset 10 is not durable yet");
        assert_eq!(t.in_flight(), 3);
        t.resolve(a);
        assert_eq!(t.advance(false).store, Some(16));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn retained_record_is_taken_once() {
        let mut t = OffsetTracker::default();
        let a = t.push(0, 5, Some("record"));
        assert_eq!(t.take_retained(a), Some("record"));
        assert_eq!(t.take_retained(a), None);
        t.put_retained(a, "again");
        assert_eq!(t.take_retained(a), Some("again"));
        t.resolve(a);
        let r = t.advance(true);
        assert_eq!(r.store, Some(1));
        assert_eq!(r.timestamps_ms, vec![5]);
        assert_eq!(t.take_retained(a), None, "released entries are gone");
    }

    #[test]
    fn unknown_local_number_is_ignored() {
        let mut t: OffsetTracker<()> = OffsetTracker::default();
        t.resolve(7);
        assert_eq!(t.advance(false).store, None);
        let a = t.push(3, 0, None);
        t.resolve(a);
        assert_eq!(t.advance(false).store, Some(4));
    }
}
