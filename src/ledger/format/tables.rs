//! Every redb table of a shard file, in one place, with the functions that name the
//! per-subscriber ones. Names carry a format version and are part of the on-disk format:
//! renaming one would make existing data directories lose (or fail to open) what it holds.

use redb::{TableDefinition, TableError};

use crate::ledger::claims::record::CLAIM_LEN;
use crate::ledger::RecordKind;

// ---- Shard-wide -------------------------------------------------------------------------

/// The keys of [`meta`], and the outcome counters of `records/`.
pub(crate) const META: TableDefinition<&str, u64> = TableDefinition::new("meta_v1");

/// Keys of the [`META`] table (part of the on-disk format: never rename one).
pub(crate) mod meta {
    /// The format the file is written in (`record::FORMAT_VERSION`).
    pub(crate) const FORMAT_VERSION: &str = "format_version";
    /// Which shard of how many the file is (checked against the manifest at open).
    pub(crate) const SHARD_INDEX: &str = "shard_index";
    pub(crate) const SHARD_COUNT: &str = "shard_count";
    /// The next ids and sequence numbers to hand out.
    pub(crate) const NEXT_TABLE_ID: &str = "next_table_id";
    pub(crate) const NEXT_QUARANTINE_SEQ: &str = "next_quarantine_seq";
    pub(crate) const NEXT_OUTBOX_SEQ: &str = "next_outbox_seq";
    pub(crate) const NEXT_DEAD_SEQ: &str = "next_dead_seq";
    /// Engine time of the last commit (format 8): a clock behind it at open is not
    /// trusted.
    pub(crate) const ENGINE_TIME_MS: &str = "engine_time_ms";
}
/// Subscriber -> placement mask: the placements its claims in this shard were written
/// under (`placement.rs`).
pub(crate) const PLACEMENTS: TableDefinition<&str, u8> = TableDefinition::new("placements_v1");
/// Subscriber -> the key source its claims in this shard were made with (JSON, as
/// [`crate::ledger::key_source_text`] writes it): a change while they live is refused.
pub(crate) const KEY_SOURCES: TableDefinition<&str, &str> = TableDefinition::new("key_sources_v1");

// ---- Claims (generations, see `claims/generation.rs`) -------------------------------------------

/// `(subscriber, table id)` -> encoded `GenMeta`.
pub(crate) const GENERATIONS: TableDefinition<(&str, u64), &[u8]> =
    TableDefinition::new("generations_v1");
/// `(subscriber, table id)` -> encoded filter of a sealed generation.
pub(crate) const FILTERS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("filters_v1");

/// Sealed generations of format 6 on: blocks of sorted claims (`claims/block.rs`).
pub(crate) const CLAIMS_PREFIX: &str = "claimblk_v1/";
/// Sealed generations up to format 5, one row per claim; rewritten as blocks on open.
pub(crate) const LEGACY_CLAIMS_PREFIX: &str = "claims_v1/";
pub(crate) const LOG_PREFIX: &str = "claimlog_v1/";

/// Sorted claims of one sealed generation: last key of a block -> encoded block of claims.
pub(crate) fn claims_name(subscriber: &str, table_id: u64) -> String {
    format!("{CLAIMS_PREFIX}{subscriber}/{table_id}")
}

/// The subscriber and table id of a [`claims_name`].
pub(crate) fn claims_generation(table: &str) -> Option<(&str, u64)> {
    let (sub, id) = table.strip_prefix(CLAIMS_PREFIX)?.rsplit_once('/')?;
    Some((sub, id.parse().ok()?))
}

/// The format-5 table of a sealed generation: key hash -> encoded claim.
pub(crate) fn legacy_claims_name(subscriber: &str, table_id: u64) -> String {
    format!("{LEGACY_CLAIMS_PREFIX}{subscriber}/{table_id}")
}

/// Append-only log of one active generation: batch row number -> packed claims.
pub(crate) fn log_name(subscriber: &str, table_id: u64) -> String {
    format!("{LOG_PREFIX}{subscriber}/{table_id}")
}

pub(crate) type ClaimsTable<'a> = TableDefinition<'a, u128, &'static [u8]>;
pub(crate) type LegacyClaimsTable<'a> = TableDefinition<'a, u128, [u8; CLAIM_LEN]>;
pub(crate) type LogTable<'a> = TableDefinition<'a, u64, &'static [u8]>;

/// The table of a sealed generation named by [`claims_name`].
pub(crate) fn claims_def(name: &str) -> ClaimsTable<'_> {
    TableDefinition::new(name)
}

/// The format-5 table of a sealed generation named by [`legacy_claims_name`].
pub(crate) fn legacy_claims_def(name: &str) -> LegacyClaimsTable<'_> {
    TableDefinition::new(name)
}

/// The table of an active generation's log named by [`log_name`].
pub(crate) fn log_def(name: &str) -> LogTable<'_> {
    TableDefinition::new(name)
}

// ---- Records kept aside for operators (`records/`) ---------------------------------------

type RecordTable = TableDefinition<'static, (&'static str, u64), &'static [u8]>;
type IndexTable = TableDefinition<'static, (&'static str, u128, u64), u64>;

/// `(subscriber, seq)` -> JSON quarantine record (same id, different payload).
pub(crate) const QUARANTINE: RecordTable = TableDefinition::new("quarantine_v1");
/// `(subscriber, seq)` -> JSON dead-letter record with the reason and the message.
pub(crate) const DEAD_LETTERS: RecordTable = TableDefinition::new("deadletters_v1");
/// `(subscriber, key hash, fingerprint)` -> seq of the quarantine record kept for that
/// message.
pub(crate) const QUARANTINE_INDEX: IndexTable = TableDefinition::new("quarantine_index_v1");
/// Same for dead letters.
pub(crate) const DEAD_LETTER_INDEX: IndexTable = TableDefinition::new("dead_letter_index_v1");

/// The records of one kind.
pub(crate) fn record_table(kind: RecordKind) -> RecordTable {
    match kind {
        RecordKind::Quarantine => QUARANTINE,
        RecordKind::DeadLetter => DEAD_LETTERS,
    }
}

/// The index of the records of one kind.
pub(crate) fn index_table(kind: RecordKind) -> IndexTable {
    match kind {
        RecordKind::Quarantine => QUARANTINE_INDEX,
        RecordKind::DeadLetter => DEAD_LETTER_INDEX,
    }
}

// ---- Outbox (`records/outbox.rs`) ----------------------------------------------------------------

/// Outbox rows: seq -> JSON, relayed after commit (see the Kafka source).
pub(crate) const OUTBOX: TableDefinition<u64, &[u8]> = TableDefinition::new("outbox_v1");
/// Changelog checkpoints, on shard 0: `<changelog topic>/<partition>` -> an offset before
/// which every change of the partition is in this data directory (`ledger/changelog.rs`).
pub(crate) const CHANGELOG_CHECKPOINTS: TableDefinition<&str, u64> =
    TableDefinition::new("changelog_checkpoints_v1");

// ---- Handler state (`state/`) ------------------------------------------------------------

/// A block table (`state/blocks.rs`) or the row table beside it: key -> block, or key ->
/// value for a row table.
pub(crate) type BlockDef<'a> = TableDefinition<'a, &'static [u8], &'static [u8]>;
/// A subscriber's state log: row number -> encoded effects of one batch.
pub(crate) type StateLogDef<'a> = TableDefinition<'a, u64, &'static [u8]>;

/// Handler key-value state: key -> value, packed into blocks.
pub(crate) fn state_name(sub: &str) -> String {
    format!("state_v2/{sub}")
}

/// `insert-unique`: marks encoded by [`crate::effects::unique_key`] -> empty value, in
/// blocks.
pub(crate) fn unique_name(sub: &str) -> String {
    format!("unique_v2/{sub}")
}

/// `advance-version`: key -> version (`u64`, little endian), in blocks.
pub(crate) fn versions_name(sub: &str) -> String {
    format!("versions_v2/{sub}")
}

/// The row table beside a block table: entries written one row each, for keys that land
/// sparsely inside the blocks' range (see `state/blocks.rs`, `apply_mixed`).
pub(crate) fn rows_name(block_table: &str) -> String {
    block_table.replacen("_v2/", "_v2_rows/", 1)
}

/// Buffered handler effects, one row per committed batch: row number -> encoded effects
/// (without outbox messages, which go to `outbox_v1` at once).
pub(crate) fn state_log_name(sub: &str) -> String {
    format!("statelog_v1/{sub}")
}

/// One sorted run of a subscriber's handler state (`state/run.rs`): last key of a block ->
/// block.
pub(crate) fn state_run_name(sub: &str, table_id: u64) -> String {
    format!("{STATE_RUN_PREFIX}{sub}/{table_id}")
}

pub(crate) const STATE_RUN_PREFIX: &str = "staterun_v1/";

/// The runs of a subscriber's handler state: table id -> encoded run metadata and filter
/// (`state/runs.rs`).
pub(crate) fn state_runs_name(sub: &str) -> String {
    format!("stateruns_v1/{sub}")
}

pub(crate) type StateRunsDef<'a> = TableDefinition<'a, u64, &'static [u8]>;

/// The subscriber whose format-3 handler state a table holds (runs, run list, log).
pub(crate) fn state_run_subscriber(table: &str) -> Option<&str> {
    if let Some(rest) = table.strip_prefix(STATE_RUN_PREFIX) {
        return rest.rsplit_once('/').map(|(sub, _)| sub);
    }
    table
        .strip_prefix("stateruns_v1/")
        .or_else(|| table.strip_prefix("statelog_v1/"))
}

/// Handler state of the first layout, one redb row per entry (`state_v1/<sub>`,
/// `unique_v1/<sub>`, `versions_v1/<sub>`): read once, by the upgrade to blocks
/// (`state/upgrade.rs`), then deleted.
pub(crate) type FirstLayoutStateDef<'a> = TableDefinition<'a, &'static [u8], &'static [u8]>;
pub(crate) type FirstLayoutUniqueDef<'a> = TableDefinition<'a, &'static [u8], ()>;
pub(crate) type FirstLayoutVersionsDef<'a> = TableDefinition<'a, &'static str, u64>;

/// The subscriber whose handler state (any layout) a table holds, if it holds state.
pub(crate) fn state_table_subscriber(table: &str) -> Option<&str> {
    let (kind, sub) = table.split_once('/')?;
    matches!(
        kind,
        "state_v1"
            | "unique_v1"
            | "versions_v1"
            | "state_v2"
            | "unique_v2"
            | "versions_v2"
            | "state_v2_rows"
            | "unique_v2_rows"
            | "versions_v2_rows"
            | "statelog_v1"
    )
    .then_some(sub)
}

// ---- Outside a data directory ------------------------------------------------------------

/// The bench's naive baseline (`backends/naive.rs`): key hash -> fingerprint in a 32-byte record.
/// Lives in its own scratch file, never in a shard file.
pub(crate) const NAIVE: TableDefinition<u128, [u8; 32]> = TableDefinition::new("naive");

/// A table that was never created reads as absent.
pub(crate) fn missing_is_none<T>(r: Result<T, TableError>) -> Result<Option<T>, redb::Error> {
    match r {
        Ok(t) => Ok(Some(t)),
        Err(TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_version_subscriber_and_id() {
        assert_eq!(claims_name("billing", 17), "claimblk_v1/billing/17");
        assert_eq!(legacy_claims_name("billing", 17), "claims_v1/billing/17");
        assert_eq!(log_name("a.b", 3), "claimlog_v1/a.b/3");
        assert_eq!(
            claims_generation(&claims_name("a/b", 17)),
            Some(("a/b", 17))
        );
        assert_eq!(claims_generation(&log_name("a", 3)), None);
        assert_eq!(claims_generation("claimblk_v1/a/x"), None);
    }

    /// The names existing data directories hold: changing one would lose their content.
    #[test]
    fn table_names_on_disk_are_unchanged() {
        use redb::TableHandle;
        let fixed = [
            META.name(),
            PLACEMENTS.name(),
            KEY_SOURCES.name(),
            GENERATIONS.name(),
            FILTERS.name(),
            QUARANTINE.name(),
            DEAD_LETTERS.name(),
            QUARANTINE_INDEX.name(),
            DEAD_LETTER_INDEX.name(),
            OUTBOX.name(),
            CHANGELOG_CHECKPOINTS.name(),
        ];
        assert_eq!(
            fixed,
            [
                "meta_v1",
                "placements_v1",
                "key_sources_v1",
                "generations_v1",
                "filters_v1",
                "quarantine_v1",
                "deadletters_v1",
                "quarantine_index_v1",
                "dead_letter_index_v1",
                "outbox_v1",
                "changelog_checkpoints_v1",
            ]
        );
        assert_eq!(state_name("s"), "state_v2/s");
        assert_eq!(unique_name("s"), "unique_v2/s");
        assert_eq!(versions_name("s"), "versions_v2/s");
        assert_eq!(rows_name(&state_name("s")), "state_v2_rows/s");
        assert_eq!(state_log_name("s"), "statelog_v1/s");
        assert_eq!(state_table_subscriber("statelog_v1/s"), Some("s"));
        assert_eq!(state_table_subscriber("claims_v1/s/1"), None);
    }
}
