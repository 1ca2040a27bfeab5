//! The record format: every kind of key, the epoch a value is published under, and the
//! encoding of values (a format byte, then bincode's standard encoding).

use crate::ledger::changelog::{Change, RecordCopy, SnapshotItem};
use crate::ledger::RecordKind;

/// The first byte of every record value: the encoding of what follows.
pub(super) const FORMAT: u8 = 1;

/// What is wrong with a changelog record's value, or why a value could not be encoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The epoch in front of a value is cut short.
    #[error("an epoch of {0} bytes, not 8")]
    Epoch(usize),
    #[error("cannot encode {} {}: {source}", .kind.0, .kind.1)]
    Encode {
        kind: Kind,
        #[source]
        source: bincode::error::EncodeError,
    },
    /// The value is damaged: bincode cannot read it as what its format byte says.
    #[error("undecodable {}: {source}", .kind.1)]
    Decode {
        kind: Kind,
        #[source]
        source: bincode::error::DecodeError,
    },
    /// The value goes on after what it holds.
    #[error("{trailing} bytes after the {}", .kind.1)]
    Trailing { kind: Kind, trailing: usize },
    /// Another format than this build reads: written by a newer (or unknown) dedupd.
    #[error("{} format {found} (this build reads format {reads}): upgrade dedupd", .kind.2)]
    Format { kind: Kind, found: u8, reads: u8 },
    #[error("an empty record")]
    Empty,
    /// A tombstone whose key starts like a quarantine or dead-letter record's but names
    /// neither.
    #[error("a record key of no known kind")]
    UnknownRecordKind,
}

fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// A change's record key: the claim key and when it was processed (both big-endian). A
/// message processed again after its claim expired is a new record, so compaction never
/// drops the state an earlier processing wrote.
pub(crate) fn record_key(change: &Change) -> [u8; 24] {
    let mut k = [0u8; 24];
    k[..16].copy_from_slice(&change.key.to_be_bytes());
    k[16..].copy_from_slice(&change.processed_at_ms.to_be_bytes());
    k
}

/// The first byte of a snapshot record's key (a change's key is 24 bytes of hash and time).
const SNAPSHOT_KEY: u8 = b'S';

/// A snapshot record's key: `S` and the xxh3-128 of the item's identity (big-endian), the
/// same for every snapshot of the item, so the log cleaner keeps only the newest.
pub(crate) fn snapshot_key(item: &SnapshotItem<'_>) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = SNAPSHOT_KEY;
    k[1..].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(&item.identity()).to_be_bytes());
    k
}

/// Whether a record key is a snapshot's.
pub(crate) fn is_snapshot_key(key: &[u8]) -> bool {
    key.len() == 17 && key[0] == SNAPSHOT_KEY
}

/// The first byte of a fence record's key.
const FENCE_KEY: u8 = b'F';
/// A fence record's value: this byte alone.
pub(super) const FENCE_FORMAT: u8 = 5;

/// A fence record's key: `F` and 16 bytes no other fence has (the producing member's
/// nonce), so the log cleaner keeps every fence: a restore needs the newest fence before
/// each record, not only the newest of the partition.
pub(crate) fn fence_key(nonce: u128) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = FENCE_KEY;
    k[1..].copy_from_slice(&nonce.to_be_bytes());
    k
}

/// Whether a record key is a fence's.
pub fn is_fence_key(key: &[u8]) -> bool {
    key.len() == 17 && key[0] == FENCE_KEY
}

/// The first byte of a value published under an epoch: then the epoch (8 bytes,
/// big-endian: the offset of the publishing member's fence in this partition), then the
/// value itself, with its own format byte.
pub(crate) const EPOCH_FORMAT: u8 = 4;

/// A record value's epoch (`None`: published with no fence, by an earlier version) and
/// the value under it.
pub(crate) fn split_epoch(value: &[u8]) -> Result<(Option<u64>, &[u8]), RecordError> {
    match value.split_first() {
        Some((&EPOCH_FORMAT, rest)) => {
            let (epoch, inner) = rest
                .split_first_chunk::<8>()
                .ok_or(RecordError::Epoch(rest.len()))?;
            Ok((Some(u64::from_be_bytes(*epoch)), inner))
        }
        _ => Ok((None, value)),
    }
}

/// The first byte of an emitted record's key.
const EMITTED_KEY: u8 = b'O';
/// The first byte of an emitted record's value (a change's is [`FORMAT`]).
pub(super) const EMITTED_FORMAT: u8 = 2;

/// An emitted record's key: `O` and the xxh3-128 of the message's id (deterministic, the
/// same for every processing that emits it), so the relay's tombstone names it.
pub(crate) fn emitted_key(message_id: &str) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = EMITTED_KEY;
    k[1..].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(message_id.as_bytes()).to_be_bytes());
    k
}

/// Whether a record key is an emitted record's.
pub(crate) fn is_emitted_key(key: &[u8]) -> bool {
    key.len() == 17 && key[0] == EMITTED_KEY
}

/// A message a handler emitted, as its changelog record carries it until the relay
/// tombstones it: with the expiry of the claim of the message that emitted it, so
/// compaction tombstones one that nothing relayed (an outbox read over HTTP) with that
/// claim's record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Emitted {
    pub(crate) expires_at_ms: u64,
    pub(crate) message: crate::effects::OutboxMessage,
}

/// An emitted message as a record value.
#[cfg(test)]
pub(crate) fn encode_emitted(emitted: &Emitted) -> Result<Vec<u8>, RecordError> {
    encode_value(EMITTED_FORMAT, EMITTED, emitted)
}

/// [`Emitted`] over a borrowed message, encoded the same (fields in the same order):
/// publishing encodes the change's own messages instead of copying each one first.
#[derive(serde::Serialize)]
pub(super) struct EmittedRef<'a> {
    pub(super) expires_at_ms: u64,
    pub(super) message: &'a crate::effects::OutboxMessage,
}

/// An emitted record's value; an error names what is wrong with it.
pub(crate) fn decode_emitted(value: &[u8]) -> Result<Emitted, RecordError> {
    decode_value(value, EMITTED_FORMAT, EMITTED)
}

/// The first byte of a quarantine or dead-letter record's key.
const RECORD_KEY: u8 = b'R';
/// The first byte of such a record's value.
pub(super) const RECORD_FORMAT: u8 = 3;
const RECORD_KEY_LEN: usize = 2 + 16 + 8;

/// A quarantine or dead-letter record's key: `R`, `q` or `d`, then the key hash and the
/// payload fingerprint its repeats are merged by (big-endian), so a repeat's record
/// replaces it and the owner's tombstone names it.
pub(crate) fn record_copy_key(copy: &RecordCopy) -> [u8; RECORD_KEY_LEN] {
    let mut k = [0u8; RECORD_KEY_LEN];
    k[0] = RECORD_KEY;
    k[1] = match copy.kind {
        RecordKind::Quarantine => b'q',
        RecordKind::DeadLetter => b'd',
    };
    k[2..18].copy_from_slice(&copy.key.to_be_bytes());
    k[18..].copy_from_slice(&copy.fingerprint.to_be_bytes());
    k
}

/// Whether a record key is a quarantine or dead-letter record's.
pub(crate) fn is_record_key(key: &[u8]) -> bool {
    key.len() == RECORD_KEY_LEN && key[0] == RECORD_KEY
}

/// The removal a tombstone with `key` stands for (a copy with no body), if the key is a
/// quarantine or dead-letter record's.
pub(crate) fn removed_record(key: &[u8], partition: i32) -> Option<RecordCopy> {
    if !is_record_key(key) {
        return None;
    }
    let kind = match key[1] {
        b'q' => RecordKind::Quarantine,
        b'd' => RecordKind::DeadLetter,
        _ => return None,
    };
    Some(RecordCopy {
        kind,
        key: u128::from_be_bytes(key[2..18].try_into().ok()?),
        fingerprint: u64::from_be_bytes(key[18..].try_into().ok()?),
        route: 0,
        body: None,
        partition,
    })
}

/// A stored quarantine or dead-letter record as a record value.
#[cfg(test)]
pub(crate) fn encode_record(copy: &RecordCopy) -> Result<Vec<u8>, RecordError> {
    encode_value(RECORD_FORMAT, RECORD, copy)
}

/// A quarantine or dead-letter record's value; an error names what is wrong with it.
pub(crate) fn decode_record(value: &[u8]) -> Result<RecordCopy, RecordError> {
    decode_value(value, RECORD_FORMAT, RECORD)
}

/// A change as a record value.
#[cfg(test)]
pub(crate) fn encode(change: &Change) -> Result<Vec<u8>, RecordError> {
    encode_value(FORMAT, CHANGE, change)
}

/// A record value as a change; an error names what is wrong with it.
pub(crate) fn decode(value: &[u8]) -> Result<Change, RecordError> {
    decode_value(value, FORMAT, CHANGE)
}

/// What a record value holds, as errors name it: (article, noun, format name).
pub(crate) type Kind = (&'static str, &'static str, &'static str);
pub(super) const CHANGE: Kind = ("a", "change", "change");
pub(super) const EMITTED: Kind = ("an", "emitted message", "emitted-message");
pub(super) const RECORD: Kind = ("a", "quarantine or dead-letter record", "record");

/// A record value: the format byte, then `v` in bincode's standard encoding.
#[cfg(test)]
fn encode_value<T: serde::Serialize>(
    format: u8,
    kind: Kind,
    v: &T,
) -> Result<Vec<u8>, RecordError> {
    let mut out = Vec::new();
    encode_value_into(&mut out, format, kind, v)?;
    Ok(out)
}

/// [`encode_value`] appended to `out`.
pub(super) fn encode_value_into<T: serde::Serialize>(
    out: &mut Vec<u8>,
    format: u8,
    kind: Kind,
    v: &T,
) -> Result<(), RecordError> {
    out.push(format);
    bincode::serde::encode_into_std_write(v, out, bincode_config())
        .map(|_| ())
        .map_err(|source| RecordError::Encode { kind, source })
}

/// The value [`encode_value`] made with `format`; an error names what is wrong with it
/// (another format, damage, trailing bytes).
fn decode_value<T: serde::de::DeserializeOwned>(
    value: &[u8],
    format: u8,
    kind: Kind,
) -> Result<T, RecordError> {
    match value.split_first() {
        Some((&f, body)) if f == format => {
            let (v, used): (T, usize) = bincode::serde::decode_from_slice(body, bincode_config())
                .map_err(|source| RecordError::Decode { kind, source })?;
            if used != body.len() {
                return Err(RecordError::Trailing {
                    kind,
                    trailing: body.len() - used,
                });
            }
            Ok(v)
        }
        Some((&found, _)) => Err(RecordError::Format {
            kind,
            found,
            reads: format,
        }),
        None => Err(RecordError::Empty),
    }
}

#[cfg(test)]
pub(super) mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use super::*;

    fn change() -> Change {
        let mut c = Change {
            key: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            id: "m-1".into(),
            fingerprint: 9,
            processed_at_ms: 1_700_000_000_000,
            expires_at_ms: 1_700_086_400_000,
            handler_version: 3,
            entity: Some("order-7".into()),
            state: Default::default(),
            uniques: Default::default(),
            versions: Default::default(),
            emitted: Vec::new(),
            origin: None,
            snapshot: false,
            record: None,
        };
        c.state.insert(b"count".to_vec(), Some(b"2".to_vec()));
        c.state.insert(b"old".to_vec(), None);
        c.uniques.insert(b"label\0order-7".to_vec());
        c.versions.insert("v".into(), 11);
        c
    }

    #[test]
    fn record_copies_round_trip_and_their_tombstones_name_them() {
        let copy = RecordCopy {
            kind: RecordKind::DeadLetter,
            key: 0xfeed_0000_0000_0000_0000_0000_0000_beef,
            fingerprint: 0x1234_5678_9abc_def0,
            route: 42,
            body: Some(br#"{"id":"m-1","count":2}"#.to_vec()),
            partition: 5,
        };
        let value = encode_record(&copy).unwrap();
        let back = decode_record(&value).unwrap();
        // The partition is the changelog partition's, not part of the value.
        assert_eq!(
            back,
            RecordCopy {
                partition: 0,
                ..copy.clone()
            }
        );
        let key = record_copy_key(&copy);
        assert!(is_record_key(&key) && !is_emitted_key(&key) && !is_snapshot_key(&key));
        assert!(!is_record_key(&record_key(&change())));
        let gone = removed_record(&key, 5).unwrap();
        assert_eq!(
            (
                gone.kind,
                gone.key,
                gone.fingerprint,
                gone.body,
                gone.partition
            ),
            (copy.kind, copy.key, copy.fingerprint, None, 5)
        );
        let quarantine = RecordCopy {
            kind: RecordKind::Quarantine,
            ..copy.clone()
        };
        assert_ne!(
            record_copy_key(&quarantine),
            key,
            "the kind is part of the key"
        );
        let mut bad = key;
        bad[1] = b'x';
        assert!(removed_record(&bad, 5).is_none());
        assert!(decode_record(&encode(&change()).unwrap()).is_err());
        assert!(decode_record(&value[..value.len() - 1]).is_err());
    }

    #[test]
    fn values_under_an_epoch_split_back_and_older_values_have_none() {
        let plain = encode(&change()).unwrap();
        assert_eq!(split_epoch(&plain).unwrap(), (None, &plain[..]));
        let mut under = vec![EPOCH_FORMAT];
        under.extend_from_slice(&7u64.to_be_bytes());
        under.extend_from_slice(&plain);
        let (epoch, inner) = split_epoch(&under).unwrap();
        assert_eq!((epoch, decode(inner).unwrap()), (Some(7), change()));
        assert!(split_epoch(&under[..5])
            .unwrap_err()
            .to_string()
            .contains("epoch of 4 bytes"));
        // A build without fences refuses such a value by its format, not as damage.
        assert!(decode(&under)
            .unwrap_err()
            .to_string()
            .contains("upgrade dedupd"));
        let f = fence_key(1);
        assert!(is_fence_key(&f));
        assert!(!is_emitted_key(&f) && !is_snapshot_key(&f) && !is_record_key(&f));
        assert!(!is_fence_key(&record_key(&change())));
        assert_ne!(fence_key(1), fence_key(2));
    }

    #[test]
    fn a_change_survives_its_record_encoding() {
        let c = change();
        assert_eq!(decode(&encode(&c).unwrap()).unwrap(), c);
    }

    /// An emitted message with every field set (also for `restore.rs`'s tests).
    pub(in crate::source::kafka::changelog) fn message(id: &str) -> crate::effects::OutboxMessage {
        crate::effects::OutboxMessage {
            id: id.into(),
            topic: "payments.captured".into(),
            key: Some("p-1".into()),
            headers: vec![("h".into(), "v".into())],
            payload: vec![0, 255, 7],
            changelog_partition: Some(3),
        }
    }

    #[test]
    fn emitted_records_round_trip() {
        let e = Emitted {
            expires_at_ms: 42,
            message: message("m-1#emit#1"),
        };
        let bytes = encode_emitted(&e).unwrap();
        // Publishing encodes a borrowed message into one buffer after other records:
        // the same bytes.
        let mut buf = encode(&change()).unwrap();
        let start = buf.len();
        let borrowed = EmittedRef {
            expires_at_ms: 42,
            message: &e.message,
        };
        encode_value_into(&mut buf, EMITTED_FORMAT, EMITTED, &borrowed).unwrap();
        assert_eq!(&buf[start..], &bytes[..]);
        assert_eq!(decode(&buf[..start]).unwrap(), change());
        let back = decode_emitted(&bytes).unwrap();
        assert_eq!(back.expires_at_ms, 42);
        // The partition is where the record is, not part of it.
        assert_eq!(back.message.changelog_partition, None);
        assert_eq!(back.message.payload, e.message.payload);
        assert!(decode(&bytes)
            .unwrap_err()
            .to_string()
            .contains("upgrade dedupd"));
        assert!(decode_emitted(&encode(&change()).unwrap()).is_err());
        assert!(decode_emitted(&bytes[..bytes.len() - 1]).is_err());

        let (k1, k2) = (emitted_key("m-1#emit#1"), emitted_key("m-1#emit#2"));
        assert_ne!(k1, k2);
        assert!(is_emitted_key(&k1) && !is_snapshot_key(&k1));
        assert!(!is_emitted_key(&record_key(&change())));
    }

    #[test]
    fn damaged_or_foreign_records_are_refused_with_the_reason() {
        let bytes = encode(&change()).unwrap();
        assert!(decode(&bytes[..bytes.len() - 3]).is_err());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer)
            .unwrap_err()
            .to_string()
            .contains("after the change"));
        let mut newer = bytes;
        newer[0] = 2;
        assert!(decode(&newer)
            .unwrap_err()
            .to_string()
            .contains("upgrade dedupd"));
        assert!(decode(&[]).is_err());
    }

    /// The texts an operator reads in the log when a restore stops at a record: each says
    /// what is wrong with the value, and a newer format says what to do.
    #[test]
    fn a_refused_record_names_what_is_wrong_with_it() {
        let bytes = encode(&change()).unwrap();
        let text = |r: Result<Change, RecordError>| r.unwrap_err().to_string();
        assert!(text(decode(&bytes[..bytes.len() - 3])).starts_with("undecodable change: "));
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0, 0]);
        assert_eq!(text(decode(&longer)), "2 bytes after the change");
        let mut newer = bytes.clone();
        newer[0] = 9;
        assert_eq!(
            text(decode(&newer)),
            "change format 9 (this build reads format 1): upgrade dedupd"
        );
        assert_eq!(
            decode_record(&bytes).unwrap_err().to_string(),
            "record format 1 (this build reads format 3): upgrade dedupd"
        );
        assert_eq!(
            decode_emitted(&[EMITTED_FORMAT, 0xff])
                .map(|_| ())
                .unwrap_err()
                .to_string()
                .split(':')
                .next(),
            Some("undecodable emitted message")
        );
        assert_eq!(text(decode(&[])), "an empty record");
        assert_eq!(
            split_epoch(&[EPOCH_FORMAT, 1, 2]).unwrap_err().to_string(),
            "an epoch of 2 bytes, not 8"
        );
    }
}
