//! The state entries of a buffer ([`StateMap`]): hashed while only point reads and writes
//! reach it, in key order once a handler scans it.
//!
//! Until 2026-12-06 buffered state was always a `BTreeMap`. With random keys each insert
//! into a buffer of up to `ledger.state_buffer_entries` (131,072) entries descended ~17
//! key comparisons, each a cache miss on a key of its own allocation: ~0.9 of the
//! 1.7 core-µs per message that effects cost in a shipping-label profile (and every
//! read that misses the buffers paid two such descents). A hashed map costs one probe; the
//! order a run needs is made once, when the buffer is frozen, on the thread that already
//! sorts its marks ([`sorted_order`]: an 8-byte key prefix compared inline, so the sort
//! rarely touches a key).

use std::collections::BTreeMap;

use foldhash::fast::RandomState;
use indexmap::IndexMap;

/// A state value as buffered (`None`: deleted).
pub(crate) type Value = Option<Vec<u8>>;

pub(crate) enum StateMap {
    /// Insertion order; [`sorted_order`] gives the key order of a frozen one.
    Hashed(IndexMap<Vec<u8>, Value, RandomState>),
    /// Key order: a subscriber whose handler scanned this buffer (and the buffers after
    /// it, which start ordered) keeps prefix scans a range walk.
    Ordered(BTreeMap<Vec<u8>, Value>),
}

impl Default for StateMap {
    fn default() -> StateMap {
        StateMap::Hashed(IndexMap::default())
    }
}

impl Clone for StateMap {
    fn clone(&self) -> StateMap {
        match self {
            StateMap::Hashed(m) => StateMap::Hashed(m.clone()),
            StateMap::Ordered(m) => StateMap::Ordered(m.clone()),
        }
    }
}

impl StateMap {
    /// An empty map of the same kind: an ordered buffer's successor starts ordered.
    pub(crate) fn empty_like(&self) -> StateMap {
        match self {
            StateMap::Hashed(_) => StateMap::default(),
            StateMap::Ordered(_) => StateMap::Ordered(BTreeMap::new()),
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            StateMap::Hashed(m) => m.len(),
            StateMap::Ordered(m) => m.len(),
        }
    }

    pub(crate) fn get(&self, key: &[u8]) -> Option<&Value> {
        match self {
            StateMap::Hashed(m) => m.get(key),
            StateMap::Ordered(m) => m.get(key),
        }
    }

    /// Sets `key` (a later write wins).
    pub(crate) fn insert(&mut self, key: Vec<u8>, value: Value) {
        match self {
            StateMap::Hashed(m) => {
                m.insert(key, value);
            }
            StateMap::Ordered(m) => {
                m.insert(key, value);
            }
        }
    }

    pub(crate) fn extend(&mut self, entries: impl IntoIterator<Item = (Vec<u8>, Value)>) {
        for (k, v) in entries {
            self.insert(k, v);
        }
    }

    pub(crate) fn is_ordered(&self) -> bool {
        matches!(self, StateMap::Ordered(_))
    }

    /// Puts the entries in key order, from now on (a scan of a hashed buffer).
    pub(crate) fn make_ordered(&mut self) {
        if let StateMap::Hashed(m) = self {
            let entries = std::mem::take(m);
            *self = StateMap::Ordered(entries.into_iter().collect());
        }
    }

    /// The entries whose key starts with `prefix`, in key order. A hashed map collects and
    /// sorts them (the views make a scanned active buffer ordered first; a frozen one is
    /// shared and stays as it is for the few batches until it is written).
    pub(crate) fn prefixed<'a>(&'a self, prefix: &'a [u8]) -> Vec<(&'a Vec<u8>, &'a Value)> {
        match self {
            StateMap::Ordered(m) => m
                .range::<[u8], _>((
                    std::ops::Bound::Included(prefix),
                    std::ops::Bound::Unbounded,
                ))
                .take_while(|(k, _)| k.starts_with(prefix))
                .collect(),
            StateMap::Hashed(m) => {
                let mut found: Vec<_> = m.iter().filter(|(k, _)| k.starts_with(prefix)).collect();
                found.sort_unstable_by(|a, b| a.0.cmp(b.0));
                found
            }
        }
    }

    /// The entry at `index` of a hashed map (`None` past its end, or for an ordered map).
    pub(crate) fn at(&self, index: usize) -> Option<(&Vec<u8>, &Value)> {
        match self {
            StateMap::Hashed(m) => m.get_index(index),
            StateMap::Ordered(_) => None,
        }
    }

    /// The ordered map's entries after `after` (from the first with `None`).
    pub(crate) fn ordered_after<'a>(
        &'a self,
        after: Option<&'a [u8]>,
    ) -> impl Iterator<Item = (&'a Vec<u8>, &'a Value)> + 'a {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, Excluded);
        match self {
            StateMap::Ordered(m) => Some(m.range::<[u8], _>((from, Unbounded))),
            StateMap::Hashed(_) => None,
        }
        .into_iter()
        .flatten()
    }
}

/// The first 8 bytes of a key as a big-endian number, zero-padded: `a < b` whenever
/// `prefix(a) < prefix(b)`, and equal prefixes need the whole keys compared.
pub(super) fn key_prefix(key: &[u8]) -> u64 {
    let mut head = [0u8; 8];
    let n = key.len().min(8);
    head[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(head)
}

/// The indexes of a hashed map's entries in key order (empty for an ordered map).
pub(super) fn sorted_order(map: &StateMap) -> Vec<u32> {
    let StateMap::Hashed(m) = map else {
        return Vec::new();
    };
    let mut order: Vec<(u64, u32)> = m
        .keys()
        .enumerate()
        .map(|(i, k)| (key_prefix(k), i as u32))
        .collect();
    order.sort_unstable_by(|a, b| {
        a.0.cmp(&b.0).then_with(|| {
            let key = |i: u32| m.get_index(i as usize).map(|(k, _)| k);
            key(a.1).cmp(&key(b.1))
        })
    });
    order.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that share 8-byte prefixes, are prefixes of each other, hold NUL and high
    /// bytes: the sorted order is the byte order, and a scan of a hashed map returns what
    /// an ordered one does.
    #[test]
    fn a_hashed_map_sorts_and_scans_like_an_ordered_one() {
        let mut keys: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b"a".to_vec(),
            b"a\0".to_vec(),
            b"a\0\0".to_vec(),
            b"abcdefgh".to_vec(),
            b"abcdefgh\0".to_vec(),
            b"abcdefgh1".to_vec(),
            b"abcdefg".to_vec(),
            vec![0xff; 9],
            vec![0xff; 3],
        ];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 12) as usize;
            keys.push(
                x.to_be_bytes()
                    .iter()
                    .cycle()
                    .take(len)
                    .map(|b| b % 4)
                    .collect(),
            );
        }
        let mut hashed = StateMap::default();
        let mut ordered = StateMap::Ordered(BTreeMap::new());
        for (i, k) in keys.iter().enumerate() {
            let v = (i % 3 != 0).then(|| i.to_le_bytes().to_vec());
            hashed.insert(k.clone(), v.clone());
            ordered.insert(k.clone(), v);
        }
        let want: Vec<(&Vec<u8>, &Value)> = ordered.ordered_after(None).collect();
        let sorted: Vec<(&Vec<u8>, &Value)> = sorted_order(&hashed)
            .into_iter()
            .map(|i| hashed.at(i as usize).unwrap())
            .collect();
        assert_eq!(sorted, want);
        for prefix in [&b""[..], b"a", b"a\0", b"abcdefgh", b"\x01\x02", b"\x03"] {
            assert_eq!(
                hashed.prefixed(prefix),
                ordered.prefixed(prefix),
                "{prefix:?}"
            );
        }
        let mut converted = hashed.clone();
        converted.make_ordered();
        assert!(converted.is_ordered() && !hashed.is_ordered());
        assert_eq!(converted.ordered_after(None).collect::<Vec<_>>(), want);
        assert!(converted.empty_like().is_ordered());
        assert!(!hashed.empty_like().is_ordered());
    }
}
