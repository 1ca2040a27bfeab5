//! Releases outcomes in source order although shards finish out of order.

use std::collections::VecDeque;

/// A reorder window: outcomes for sequence numbers `next..` may arrive in any order;
/// `release` hands them back strictly in order, without gaps.
#[derive(Debug)]
pub(crate) struct Sequencer<T> {
    next: u64,
    slots: VecDeque<Option<T>>,
}

impl<T> Default for Sequencer<T> {
    fn default() -> Self {
        Sequencer::starting_at(0)
    }
}

impl<T> Sequencer<T> {
    pub(crate) fn starting_at(first: u64) -> Self {
        Sequencer {
            next: first,
            slots: VecDeque::new(),
        }
    }

    /// Records the item for `seq`. Items below the watermark (already released) are ignored.
    pub(crate) fn insert(&mut self, seq: u64, item: T) {
        if seq < self.next {
            return;
        }
        let at = (seq - self.next) as usize;
        if self.slots.len() <= at {
            self.slots.resize_with(at + 1, || None);
        }
        self.slots[at] = Some(item);
    }

    /// The sequence number `pop_ready` would return, if its item is present.
    pub(crate) fn next_ready(&self) -> Option<u64> {
        matches!(self.slots.front(), Some(Some(_))).then_some(self.next)
    }

    /// Pops the next item if it is present.
    pub(crate) fn pop_ready(&mut self) -> Option<(u64, T)> {
        match self.slots.front() {
            Some(Some(_)) => {
                let item = self.slots.pop_front().flatten()?;
                let seq = self.next;
                self.next += 1;
                Some((seq, item))
            }
            _ => None,
        }
    }

    /// The first sequence number not yet released (the contiguous watermark).
    pub(crate) fn watermark(&self) -> u64 {
        self.next
    }

    /// Items received but waiting for a gap to close.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_in_order_after_gap_closes() {
        let mut s = Sequencer::starting_at(1);
        s.insert(3, "c");
        s.insert(2, "b");
        assert_eq!(s.pop_ready(), None);
        assert_eq!(s.watermark(), 1);
        s.insert(1, "a");
        let got: Vec<_> = std::iter::from_fn(|| s.pop_ready()).collect();
        assert_eq!(got, vec![(1, "a"), (2, "b"), (3, "c")]);
        assert_eq!(s.watermark(), 4);
    }

    #[test]
    fn released_sequence_is_ignored() {
        let mut s = Sequencer::starting_at(0);
        s.insert(0, 1);
        assert_eq!(s.pop_ready(), Some((0, 1)));
        s.insert(0, 2);
        assert_eq!(s.pop_ready(), None);
        assert_eq!(s.waiting(), 0);
    }
}
