//! On-disk record layouts. Fixed little-endian layouts, each with a format version, so a
//! record can be read without a schema and a newer store is refused instead of misread.

/// Version of the whole on-disk format (manifest, tables, records). Bump on any change;
/// an older binary then refuses the directory instead of misreading it.
///
/// - 1: claims, generations, records; handler state moved from one row per entry
///   (`state_v1`) to blocks (`state_v2`) within format 1.
/// - 2: placements (`placements_v1`); handler state of entity-placed subscribers is scoped
///   to the entity; quarantine and dead-letter records are one per message and payload
///   (index tables, `count`), with outcome counters in `meta_v1`. Format-1 shards are upgraded on open: their subscribers are marked as
///   placed anywhere, so every shard is asked for their claims.
/// - 3: handler state in sorted runs (`staterun_v1`, `stateruns_v1`); the block and row
///   tables of format 2 are rewritten as one run per subscriber on open.
/// - 4: blocks of bigger state runs may be zstd-compressed (a block's first byte says
///   which). Format-3 shards are read as they are; only older binaries must refuse them.
/// - 5: a state merge frees its inputs' blocks behind its cursor and records its progress
///   in the run list (`state/runs.rs`); an older binary would read the half-freed inputs
///   as whole. Format-3 and -4 shards are read as they are.
/// - 6: sealed generations store blocks of claims (`claimblk_v1`, `block.rs`) instead
///   of one row per claim (`claims_v1`); format-5 tables are rewritten as blocks on open.
/// - 7: new sealed generations get split-block Bloom filters (filter kind 3, `filter.rs`)
///   instead of binary fuse filters; an older binary would take one for damage and
///   rebuild it at every open. Format-6 shards are read as they are (fuse filters stay
///   until their generations merge).
/// - 8: handlers' derived identities (operation keys, emitted message ids, the random
///   stream) of messages whose id text does not identify them alone (a CloudEvents
///   `source#id`, a Kafka header id that is not UTF-8) are made from the key hash
///   (`handler/host.rs`, `seed`); those of every other message are unchanged. `meta_v1`
///   holds `engine_time_ms`, the engine time of the last commit, below which a start never
///   begins; `key_sources_v1` the key source of each subscriber's claims; a state run list
///   the first log row no run covers (covered rows are deleted later). An older binary
///   would derive other ids for the same messages and replay covered rows.
pub const FORMAT_VERSION: u64 = 8;

/// Bytes of an encoded [`ClaimRecord`].
pub(crate) const CLAIM_LEN: usize = 32;

/// What a claim remembers about a processed `(subscriber, id)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRecord {
    /// xxh3-64 of the canonical payload (G4).
    pub fingerprint: u64,
    /// When the message was first processed, ms since the epoch.
    pub processed_at_ms: u64,
    /// When the claim stops counting, ms since the epoch. Reads treat expired claims as absent.
    pub expires_at_ms: u64,
    /// The handler version that processed it (0: no handler).
    pub handler_version: u64,
}

impl ClaimRecord {
    pub(crate) fn encode(&self) -> [u8; CLAIM_LEN] {
        let mut out = [0u8; CLAIM_LEN];
        out[0..8].copy_from_slice(&self.fingerprint.to_le_bytes());
        out[8..16].copy_from_slice(&self.processed_at_ms.to_le_bytes());
        out[16..24].copy_from_slice(&self.expires_at_ms.to_le_bytes());
        out[24..32].copy_from_slice(&self.handler_version.to_le_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8; CLAIM_LEN]) -> Self {
        ClaimRecord {
            fingerprint: read_u64(b, 0),
            processed_at_ms: read_u64(b, 8),
            expires_at_ms: read_u64(b, 16),
            handler_version: read_u64(b, 24),
        }
    }

    /// A claim that counts: not expired and not forgotten.
    #[inline]
    pub fn is_live(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms && !self.is_tombstone()
    }

    /// Whether sealing and merging must keep the record: a tombstone is kept until the
    /// claim it shadows would have expired, so that claim can never resurface.
    #[inline]
    pub(crate) fn is_retained(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms
    }

    /// A record written by `forget`: it shadows older copies of the claim and reads as absent.
    #[inline]
    pub(crate) fn is_tombstone(&self) -> bool {
        self.handler_version == TOMBSTONE
    }

    /// The newer of two records of one key held by different shards (I2 across shards):
    /// the later `processed_at_ms` wins; on a tie, the first.
    pub(crate) fn newer(a: Option<ClaimRecord>, b: Option<ClaimRecord>) -> Option<ClaimRecord> {
        match (a, b) {
            (Some(x), Some(y)) if y.processed_at_ms > x.processed_at_ms => Some(y),
            (Some(x), _) => Some(x),
            (None, y) => y,
        }
    }

    /// The tombstone that forgets `claim` at `now_ms`.
    pub(crate) fn tombstone_of(claim: &ClaimRecord, now_ms: u64) -> ClaimRecord {
        ClaimRecord {
            fingerprint: claim.fingerprint,
            processed_at_ms: now_ms,
            expires_at_ms: claim.expires_at_ms,
            handler_version: TOMBSTONE,
        }
    }
}

/// `handler_version` of a forgotten claim (no real handler version is all ones).
pub(crate) const TOMBSTONE: u64 = u64::MAX;

#[inline]
fn read_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// One log row: the claims one committed batch added to one active generation.
/// Layout: `version u8 | count u32 | count × (key u128 | claim 32 bytes)`.
pub struct LogRow;

const LOG_VERSION: u8 = 1;
const LOG_ENTRY: usize = 16 + CLAIM_LEN;

impl LogRow {
    pub fn start(buf: &mut Vec<u8>) {
        buf.clear();
        buf.push(LOG_VERSION);
        buf.extend_from_slice(&0u32.to_le_bytes());
    }

    pub fn push(buf: &mut Vec<u8>, key: u128, claim: &ClaimRecord) {
        buf.extend_from_slice(&key.to_le_bytes());
        buf.extend_from_slice(&claim.encode());
        let n = (buf.len() - 5) / LOG_ENTRY;
        buf[1..5].copy_from_slice(&(n as u32).to_le_bytes());
    }

    pub(crate) fn is_empty(buf: &[u8]) -> bool {
        buf.len() <= 5
    }

    /// Decodes a row; `Err` names what is wrong so corruption is reported, not skipped.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<(u128, ClaimRecord)>, ClaimRowError> {
        if bytes.len() < 5 {
            return Err(ClaimRowError::LogRowShort(bytes.len()));
        }
        if bytes[0] != LOG_VERSION {
            return Err(ClaimRowError::LogRowVersion(bytes[0]));
        }
        let n = u32::from_le_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
        if bytes.len() != 5 + n * LOG_ENTRY {
            return Err(ClaimRowError::LogRowLength {
                entries: n,
                bytes: bytes.len(),
            });
        }
        let mut out = Vec::with_capacity(n);
        for chunk in bytes[5..].chunks_exact(LOG_ENTRY) {
            let mut k = [0u8; 16];
            k.copy_from_slice(&chunk[..16]);
            let mut c = [0u8; CLAIM_LEN];
            c.copy_from_slice(&chunk[16..]);
            out.push((u128::from_le_bytes(k), ClaimRecord::decode(&c)));
        }
        Ok(out)
    }
}

/// What is wrong with a stored log row or generation record: reported as corruption,
/// never skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ClaimRowError {
    #[error("log row of {0} bytes is too short")]
    LogRowShort(usize),
    #[error("log row version {0} is unknown")]
    LogRowVersion(u8),
    #[error("log row says {entries} entries but holds {bytes} bytes")]
    LogRowLength { entries: usize, bytes: usize },
    #[error("generation record ({bytes} bytes, version {version:?}) is not readable")]
    Generation { bytes: usize, version: Option<u8> },
    #[error("generation state {0} is unknown")]
    GenerationState(u8),
}

/// Lifecycle of a generation as recorded in the generations table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GenState {
    /// Claims live in the log table and the in-memory index.
    Active = 1,
    /// Being written into its sorted table; the log is still the source of truth.
    Sealing = 2,
    /// Sorted table and filter are complete; no log.
    Sealed = 3,
}

/// Metadata of one generation. Layout: `version u8 | state u8 | order u64 | count u64 |
/// max_expires u64 | created_at u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GenMeta {
    pub(crate) state: GenState,
    /// Recency rank within a subscriber: a higher order supersedes a lower one.
    pub(crate) order: u64,
    pub(crate) count: u64,
    pub(crate) max_expires_ms: u64,
    pub(crate) created_at_ms: u64,
}

const GEN_VERSION: u8 = 1;
pub(crate) const GEN_META_LEN: usize = 34;

impl GenMeta {
    pub(crate) fn encode(&self) -> [u8; GEN_META_LEN] {
        let mut out = [0u8; GEN_META_LEN];
        out[0] = GEN_VERSION;
        out[1] = self.state as u8;
        out[2..10].copy_from_slice(&self.order.to_le_bytes());
        out[10..18].copy_from_slice(&self.count.to_le_bytes());
        out[18..26].copy_from_slice(&self.max_expires_ms.to_le_bytes());
        out[26..34].copy_from_slice(&self.created_at_ms.to_le_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, ClaimRowError> {
        if b.len() != GEN_META_LEN || b[0] != GEN_VERSION {
            return Err(ClaimRowError::Generation {
                bytes: b.len(),
                version: b.first().copied(),
            });
        }
        let state = match b[1] {
            1 => GenState::Active,
            2 => GenState::Sealing,
            3 => GenState::Sealed,
            s => return Err(ClaimRowError::GenerationState(s)),
        };
        Ok(GenMeta {
            state,
            order: read_u64(b, 2),
            count: read_u64(b, 10),
            max_expires_ms: read_u64(b, 18),
            created_at_ms: read_u64(b, 26),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing;
    use proptest::prelude::*;

    fn claim() -> impl Strategy<Value = ClaimRecord> {
        any::<[u64; 4]>().prop_map(|[a, b, c, d]| ClaimRecord {
            fingerprint: a,
            processed_at_ms: b,
            expires_at_ms: c,
            handler_version: d,
        })
    }

    fn valid_log_row() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec((any::<u128>(), claim()), 0..12).prop_map(|entries| {
            let mut buf = Vec::new();
            LogRow::start(&mut buf);
            for (k, c) in &entries {
                LogRow::push(&mut buf, *k, c);
            }
            buf
        })
    }

    fn gen_meta() -> impl Strategy<Value = GenMeta> {
        let state =
            prop::sample::select(vec![GenState::Active, GenState::Sealing, GenState::Sealed]);
        (state, any::<[u64; 4]>()).prop_map(
            |(state, [order, count, max_expires_ms, created_at_ms])| GenMeta {
                state,
                order,
                count,
                max_expires_ms,
                created_at_ms,
            },
        )
    }

    #[test]
    fn fuzz_claim_records_of_any_bytes_round_trip() {
        fuzzing::run("claim_record", 2000, any::<[u8; CLAIM_LEN]>(), |b| {
            prop_assert_eq!(ClaimRecord::decode(&b).encode(), b);
            Ok(())
        });
    }

    /// A log row that decodes is exactly the row its entries encode to; anything else
    /// (a count that disagrees with the length, a version, a cut) is refused.
    #[test]
    fn fuzz_log_row_decode_refuses_or_reencodes_as_read() {
        fuzzing::run(
            "log_row",
            3000,
            fuzzing::hostile(400, valid_log_row()),
            |b| {
                if let Ok(entries) = LogRow::decode(&b) {
                    fuzzing::decoded();
                    let mut again = Vec::new();
                    LogRow::start(&mut again);
                    for (k, c) in &entries {
                        LogRow::push(&mut again, *k, c);
                    }
                    prop_assert_eq!(again, b);
                }
                Ok(())
            },
        );
    }

    #[test]
    fn fuzz_log_rows_round_trip() {
        fuzzing::run("log_row_round_trip", 500, valid_log_row(), |b| {
            let entries = LogRow::decode(&b).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(5 + entries.len() * LOG_ENTRY, b.len());
            Ok(())
        });
    }

    #[test]
    fn fuzz_gen_meta_decode_refuses_or_reencodes_as_read() {
        let valid = gen_meta().prop_map(|m| m.encode().to_vec());
        fuzzing::run("gen_meta", 3000, fuzzing::hostile(48, valid), |b| {
            if let Ok(m) = GenMeta::decode(&b) {
                fuzzing::decoded();
                prop_assert_eq!(&m.encode()[..], &b[..]);
            }
            Ok(())
        });
        fuzzing::run("gen_meta_round_trip", 500, gen_meta(), |m| {
            prop_assert_eq!(GenMeta::decode(&m.encode()), Ok(m));
            Ok(())
        });
    }

    #[test]
    fn claim_round_trips() {
        let c = ClaimRecord {
            fingerprint: 1,
            processed_at_ms: 2,
            expires_at_ms: u64::MAX,
            handler_version: 7,
        };
        assert_eq!(ClaimRecord::decode(&c.encode()), c);
        assert!(c.is_live(3));
    }

    #[test]
    fn log_row_round_trips_and_detects_truncation() {
        let mut buf = Vec::new();
        LogRow::start(&mut buf);
        assert!(LogRow::is_empty(&buf));
        let c = ClaimRecord {
            fingerprint: 9,
            processed_at_ms: 10,
            expires_at_ms: 11,
            handler_version: 0,
        };
        LogRow::push(&mut buf, 42, &c);
        LogRow::push(&mut buf, u128::MAX, &c);
        assert_eq!(
            LogRow::decode(&buf).expect("row"),
            vec![(42, c), (u128::MAX, c)]
        );
        assert!(LogRow::decode(&buf[..buf.len() - 1]).is_err());
        let mut wrong = buf.clone();
        wrong[0] = 99;
        assert!(LogRow::decode(&wrong).is_err());
    }

    #[test]
    fn gen_meta_round_trips() {
        let m = GenMeta {
            state: GenState::Sealing,
            order: 3,
            count: 4,
            max_expires_ms: 5,
            created_at_ms: 6,
        };
        assert_eq!(GenMeta::decode(&m.encode()).expect("meta"), m);
        assert!(GenMeta::decode(&[0u8; 3]).is_err());
    }
}
