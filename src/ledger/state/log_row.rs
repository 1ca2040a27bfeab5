//! One batch's handler effects as a row of a subscriber's state log (`statelog_v1/<sub>`):
//! written in the batch's transaction, read back when the buffer is rebuilt after a crash
//! or a stop.

use crate::effects::Effects;

/// One batch's effects as a row, written whole (the tests'; a batch writes its row with
/// [`RowWriter`] call by call).
#[cfg(test)]
pub(super) fn encode_effects(e: &Effects) -> Vec<u8> {
    let mut row = RowWriter::default();
    for (k, v) in &e.state {
        row.state(&[k], v.as_deref());
    }
    for m in &e.uniques {
        row.unique(&[m]);
    }
    for (k, v) in &e.versions {
        row.version(&[k.as_bytes()], *v);
    }
    row.finish().unwrap_or_else(|| vec![0; 12])
}

/// Log row format (v1): three sections, each `count u32` then entries; integers are little
/// endian, byte strings `len u32` + bytes.
/// state: key, tag (0 delete, 1 put), value when put; uniques: mark; versions: key, u64.
/// A key may appear more than once in a section (a batch's calls are encoded as they
/// succeed, not merged first): the later entry wins, as when rows replay in order.
///
/// A log row is encoded as a batch's calls succeed, one section per kind, so the effects go
/// straight into the shard's buffer and nothing is merged into an ordered map first.
/// Keys come in parts (an entity scope, then the handler's key) and are written joined.
#[derive(Default)]
pub(super) struct RowWriter {
    sections: [Vec<u8>; 3],
    counts: [u32; 3],
}

const STATE: usize = 0;
const UNIQUES: usize = 1;
const VERSIONS: usize = 2;

impl RowWriter {
    fn key(&mut self, section: usize, parts: &[&[u8]]) -> &mut Vec<u8> {
        self.counts[section] += 1;
        let out = &mut self.sections[section];
        let len: usize = parts.iter().map(|p| p.len()).sum();
        out.extend_from_slice(&(len as u32).to_le_bytes());
        for p in parts {
            out.extend_from_slice(p);
        }
        out
    }

    /// A state write (`None`: delete).
    pub(crate) fn state(&mut self, key: &[&[u8]], value: Option<&[u8]>) {
        let out = self.key(STATE, key);
        match value {
            Some(v) => {
                out.push(1);
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
            None => out.push(0),
        }
    }

    pub(crate) fn unique(&mut self, mark: &[&[u8]]) {
        self.key(UNIQUES, mark);
    }

    pub(crate) fn version(&mut self, key: &[&[u8]], version: u64) {
        self.key(VERSIONS, key)
            .extend_from_slice(&version.to_le_bytes());
    }

    /// The row; `None` when nothing was written.
    pub(crate) fn finish(self) -> Option<Vec<u8>> {
        if self.counts == [0; 3] {
            return None;
        }
        let mut out = Vec::with_capacity(12 + self.sections.iter().map(Vec::len).sum::<usize>());
        for (count, section) in self.counts.iter().zip(&self.sections) {
            out.extend_from_slice(&count.to_le_bytes());
            out.extend_from_slice(section);
        }
        Some(out)
    }
}

/// Decodes a log row; `None` when it is not a well-formed row.
pub(super) fn decode_effects(mut b: &[u8]) -> Option<Effects> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Some(head)
    }
    fn u32_(b: &mut &[u8]) -> Option<usize> {
        Some(u32::from_le_bytes(take(b, 4)?.try_into().ok()?) as usize)
    }
    fn bytes(b: &mut &[u8]) -> Option<Vec<u8>> {
        let n = u32_(b)?;
        Some(take(b, n)?.to_vec())
    }
    let mut e = Effects::default();
    for _ in 0..u32_(&mut b)? {
        let k = bytes(&mut b)?;
        let v = match take(&mut b, 1)?[0] {
            0 => None,
            1 => Some(bytes(&mut b)?),
            _ => return None,
        };
        e.state.insert(k, v);
    }
    for _ in 0..u32_(&mut b)? {
        e.uniques.insert(bytes(&mut b)?);
    }
    for _ in 0..u32_(&mut b)? {
        let k = String::from_utf8(bytes(&mut b)?).ok()?;
        let v = u64::from_le_bytes(take(&mut b, 8)?.try_into().ok()?);
        e.versions.insert(k, v);
    }
    b.is_empty().then_some(e)
}

#[cfg(test)]
mod tests {
    use super::super::testing::put;
    use super::*;
    use crate::effects::unique_key;

    #[test]
    fn log_rows_round_trip_and_reject_garbage() {
        let mut e = Effects::default();
        put(&mut e, "a", Some("1"));
        put(&mut e, "b", None);
        e.uniques.insert(unique_key("label", "o-1"));
        e.versions.insert("order/1".into(), 7);
        let row = encode_effects(&e);
        assert_eq!(decode_effects(&row), Some(e));
        assert_eq!(decode_effects(&row[..row.len() - 1]), None);
        let mut longer = row.clone();
        longer.push(0);
        assert_eq!(decode_effects(&longer), None);
    }

    /// Calls encoded as they come may write a key twice in one row: the later entry wins
    /// when the row is read back, as when two rows replay in order.
    #[test]
    fn a_row_written_call_by_call_reads_back_with_the_later_write_winning() {
        let mut row = RowWriter::default();
        assert!(RowWriter::default().finish().is_none(), "nothing written");
        row.state(&[b"e\0", b"k"], Some(b"1"));
        row.unique(&[b"e\0", b"label\0o-1"]);
        row.version(&[b"e\0", b"v"], 1);
        row.state(&[b"e\0", b"k"], None);
        row.state(&[b"e\0k"], Some(b"2"));
        row.version(&[b"e\0v"], 2);
        let mut want = Effects::default();
        put(&mut want, "e\0k", Some("2"));
        want.uniques.insert(b"e\0label\0o-1".to_vec());
        want.versions.insert("e\0v".into(), 2);
        assert_eq!(decode_effects(&row.finish().unwrap()), Some(want));
    }
}
