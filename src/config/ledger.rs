//! `[ledger]`: the storage engine's settings, each count within its documented range.

use std::num::NonZeroUsize;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{invalid, nz, ConfigError};

/// Storage engine settings. See `docs/design.md` for how they interact.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerConfig {
    /// Number of shards (one redb file and one writer thread each). Default: number of cores.
    /// Fixed when a data directory is created; a different value later is an error.
    pub shards: Option<NonZeroUsize>,
    /// Most messages in one commit. A batch grows while the previous commit's fsync runs.
    /// 1 to 1,048,576.
    pub max_batch: NonZeroUsize,
    /// How long a writer waits for more messages before committing a small batch (under
    /// 256 jobs), while they keep coming (a pause of half of it ends the wait): fewer
    /// commits, and less CPU a message, at moderate load, for up to this much ack latency.
    /// 0 (the default) commits at once. At most 1 s.
    #[serde(with = "humantime_serde")]
    pub(crate) max_linger: Duration,
    /// Claims in an active generation before it is sealed into a sorted table. A busy
    /// subscriber's in-memory index is sized for this many plus one batch (a generation
    /// seals after the batch that filled it): a hash table of 49-byte slots, a power of two
    /// of them at most 7/8 full. The default, 440,000, with the default `max_batch` fits
    /// 2^19 slots (24.5 MiB per shard); 524,288 needed 2^20. 16 to 16,777,216.
    pub generation_max_claims: NonZeroUsize,
    /// Age at which a non-empty active generation is sealed even when not full.
    #[serde(with = "humantime_serde")]
    pub generation_max_age: Duration,
    /// Sealed generations smaller than this are merged with a neighbour.
    /// 16 to 1,073,741,824.
    pub merge_max_claims: NonZeroUsize,
    /// Sealed generations per subscriber and shard above which merging starts (a lookup
    /// may probe each of them). 1 to 1,024.
    pub merge_trigger_generations: NonZeroUsize,
    /// Handler state entries (puts, deletes, uniqueness marks, versions) buffered in memory
    /// per subscriber and shard, and logged, before they are applied to the sorted state
    /// tables in key order. Larger: fewer, denser rewrites of the tables; more memory
    /// (roughly 150-250 bytes per entry, up to twice this many while one buffer is applied).
    /// 16 to 4,194,304.
    pub state_buffer_entries: NonZeroUsize,
    /// redb page cache per shard, in MiB. The OS page cache serves the rest. 1 to 65,536.
    pub cache_mib: NonZeroUsize,
    /// Verify every page checksum when a shard file is opened, so a file damaged outside
    /// dedupd is reported instead of trusted. Reads the whole file at start-up.
    pub verify_on_open: bool,
    /// Most subscribers that are not in the config (created by the first message that
    /// names them, when `allow_unknown_subscribers` is true; those found in the data
    /// directory count too). Each costs memory on every shard; past the limit a message
    /// for a new name is refused (HTTP 403 `subscriber_limit`). Configured subscribers are
    /// never limited. 0 to 65,536.
    pub(crate) max_implicit_subscribers: usize,
    /// How long a quarantine or dead-letter record is kept after it was first stored; older
    /// ones are removed between batches (the outcomes stay counted).
    #[serde(with = "humantime_serde")]
    pub record_retention: Duration,
    /// Most quarantine records, and separately most dead-letter records, kept per
    /// subscriber (split evenly over the shards). Past it the oldest record is dropped and
    /// counted in `dedupd_records_dropped_total`; the outcome is still reported and counted.
    pub max_records_per_subscriber: NonZeroUsize,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            shards: None,
            max_batch: nz(16_384),
            max_linger: Duration::ZERO,
            generation_max_claims: nz(440_000),
            generation_max_age: Duration::from_secs(3600),
            merge_max_claims: nz(1 << 23),
            merge_trigger_generations: nz(8),
            state_buffer_entries: nz(1 << 17),
            cache_mib: nz(32),
            verify_on_open: true,
            max_implicit_subscribers: 64,
            record_retention: Duration::from_secs(30 * 24 * 3600),
            max_records_per_subscriber: nz(100_000),
        }
    }
}

impl LedgerConfig {
    /// Claims a busy subscriber's full-size index is allocated for: a generation, plus the
    /// batch that fills it, which ends before the generation is sealed. Smaller, and the
    /// last batch rehashed the table into twice the memory inside the batch.
    pub(crate) fn full_index_claims(&self) -> usize {
        self.generation_max_claims.get() + self.max_batch.get()
    }

    /// Every count within its documented range, so a nonsense value is refused here with
    /// the field's name instead of exhausting memory (or overflowing) in a shard thread.
    pub(super) fn validate_sizes(&self) -> Result<(), ConfigError> {
        let sizes = [
            ("max_batch", self.max_batch.get(), 1, 1 << 20),
            (
                "generation_max_claims",
                self.generation_max_claims.get(),
                16,
                1 << 24,
            ),
            ("merge_max_claims", self.merge_max_claims.get(), 16, 1 << 30),
            (
                "merge_trigger_generations",
                self.merge_trigger_generations.get(),
                1,
                1024,
            ),
            (
                "state_buffer_entries",
                self.state_buffer_entries.get(),
                16,
                1 << 22,
            ),
            ("cache_mib", self.cache_mib.get(), 1, 1 << 16),
            (
                "max_implicit_subscribers",
                self.max_implicit_subscribers,
                0,
                1 << 16,
            ),
        ];
        for (field, value, min, max) in sizes {
            if !(min..=max).contains(&value) {
                return Err(invalid(
                    format!("ledger.{field}"),
                    format!("is {value}; it must be between {min} and {max}"),
                ));
            }
        }
        Ok(())
    }
}
