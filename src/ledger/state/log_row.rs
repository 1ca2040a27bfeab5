//! One batch's handler effects as a row of a subscriber's state log (`statelog_v1/<sub>`):
//! written in the batch's transaction, read back when the buffer is rebuilt after a crash
//! or a stop.

use crate::effects::Effects;

/// Log row format (v1): three sections, each `count u32` then entries; integers are little
/// endian, byte strings `len u32` + bytes.
/// state: key, tag (0 delete, 1 put), value when put; uniques: mark; versions: key, u64.
pub(super) fn encode_effects(e: &Effects) -> Vec<u8> {
    fn bytes(out: &mut Vec<u8>, b: &[u8]) {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    }
    let mut out = Vec::with_capacity(
        12 + e
            .state
            .iter()
            .map(|(k, v)| 9 + k.len() + v.as_ref().map_or(0, Vec::len))
            .sum::<usize>()
            + e.uniques.iter().map(|m| 4 + m.len()).sum::<usize>()
            + e.versions.keys().map(|k| 12 + k.len()).sum::<usize>(),
    );
    out.extend_from_slice(&(e.state.len() as u32).to_le_bytes());
    for (k, v) in &e.state {
        bytes(&mut out, k);
        match v {
            Some(v) => {
                out.push(1);
                bytes(&mut out, v);
            }
            None => out.push(0),
        }
    }
    out.extend_from_slice(&(e.uniques.len() as u32).to_le_bytes());
    for m in &e.uniques {
        bytes(&mut out, m);
    }
    out.extend_from_slice(&(e.versions.len() as u32).to_le_bytes());
    for (k, v) in &e.versions {
        bytes(&mut out, k.as_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
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
}
