//! Every redb table of a shard file, in one place. Names carry a format version.

use redb::TableDefinition;

/// `format_version`, `shard_index`, `shard_count`, `next_table_id`, `next_quarantine_seq`.
pub const META: TableDefinition<&str, u64> = TableDefinition::new("meta_v1");
/// `(subscriber, table id)` -> encoded `GenMeta`.
pub const GENERATIONS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("generations_v1");
/// `(subscriber, table id)` -> encoded filter of a sealed generation.
pub const FILTERS: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("filters_v1");
/// `(subscriber, seq)` -> JSON quarantine record (same id, different payload).
pub const QUARANTINE: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("quarantine_v1");

/// Subscriber -> placement mask: the placements its claims in this shard were written
/// under (`placement.rs`).
pub const PLACEMENTS: TableDefinition<&str, u8> = TableDefinition::new("placements_v1");

pub const CLAIMS_PREFIX: &str = "claims_v1/";
pub const LOG_PREFIX: &str = "claimlog_v1/";

/// Sorted claims of one sealed generation: key hash -> encoded claim.
pub fn claims_name(subscriber: &str, table_id: u64) -> String {
    format!("{CLAIMS_PREFIX}{subscriber}/{table_id}")
}

/// Append-only log of one active generation: batch row number -> packed claims.
pub fn log_name(subscriber: &str, table_id: u64) -> String {
    format!("{LOG_PREFIX}{subscriber}/{table_id}")
}

pub type ClaimsTable<'a> = TableDefinition<'a, u128, [u8; crate::ledger::record::CLAIM_LEN]>;
pub type LogTable<'a> = TableDefinition<'a, u64, &'static [u8]>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_version_subscriber_and_id() {
        assert_eq!(claims_name("billing", 17), "claims_v1/billing/17");
        assert_eq!(log_name("a.b", 3), "claimlog_v1/a.b/3");
    }
}
