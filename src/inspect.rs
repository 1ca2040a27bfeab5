//! Offline looks into a data directory: `dedupd inspect` (what each subscriber holds) and
//! `dedupd state dump` (a subscriber's handler state as JSON lines).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::clock::SystemClock;
use crate::config::Config;
use crate::ledger::{
    disk_usage, offline_report, DiskUsage, Ledger, LedgerError, LedgerReport, OpenObserver,
    MANIFEST,
};

/// Why an offline look failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InspectError {
    /// Refused so that a typo does not create an empty data directory.
    #[error("{} is not a dedupd data directory (no dedupd.manifest.json)", .0.display())]
    NotADataDir(PathBuf),
    #[error("{} is in use by a running dedupd: inspect reads only closed files; the running engine reports the same counts live (`GET /v1/subscribers`, `GET /v1/subscribers/NAME/stats`, the dashboard, `/metrics`)", .0.display())]
    Running(PathBuf),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("writing the output failed: {0}")]
    Output(#[from] std::io::Error),
    #[error("subscriber {subscriber:?} has nothing stored in {} and is not in the config; `dedupd inspect --data-dir {}` lists the subscribers it holds", .dir.display(), .dir.display())]
    UnknownSubscriber { subscriber: String, dir: PathBuf },
}

/// Opens an existing data directory (never creates one), telling `observer` how the open
/// goes if there is one.
fn open_existing(
    dir: &Path,
    config: &Config,
    observer: Option<OpenObserver>,
) -> Result<Ledger, InspectError> {
    if !dir.join(MANIFEST).exists() {
        return Err(InspectError::NotADataDir(dir.to_path_buf()));
    }
    let clock = Arc::new(SystemClock);
    Ok(match observer {
        Some(observer) => Ledger::open_observed(dir, config, clock, observer)?,
        None => Ledger::open(dir, config, clock)?,
    })
}

/// Claims, generations, records and state runs per subscriber, and where the bytes go,
/// read without writing: every shard file is opened read-only, so the files are left as
/// they were. A directory held by a running engine is refused (its admin API reports the
/// same counts live); one the engine did not close cleanly needs `repair`.
pub fn inspect(dir: &Path) -> Result<LedgerReport, InspectError> {
    if !dir.join(MANIFEST).exists() {
        return Err(InspectError::NotADataDir(dir.to_path_buf()));
    }
    let mut report = offline_report(dir).map_err(|e| match e {
        LedgerError::InUse { .. } => InspectError::Running(dir.to_path_buf()),
        e => e.into(),
    })?;
    report.disk = Some(disk_usage(dir, report.shards)?);
    Ok(report)
}

/// [`inspect`] after opening the engine on the directory, which writes: it repairs a file
/// not closed cleanly, finishes interrupted seals and merges and upgrades an older format.
/// The in-memory index sizes are reported too.
pub fn inspect_repairing(dir: &Path, config: &Config) -> Result<LedgerReport, InspectError> {
    report_repaired(dir, config, None)
}

/// [`inspect_repairing`], telling `observer` what each shard's open does (the repair of a
/// file a killed engine left is the long step: redb scans the whole file), from the
/// shards' threads as it happens.
pub fn inspect_repairing_observed(
    dir: &Path,
    config: &Config,
    observer: OpenObserver,
) -> Result<LedgerReport, InspectError> {
    report_repaired(dir, config, Some(observer))
}

fn report_repaired(
    dir: &Path,
    config: &Config,
    observer: Option<OpenObserver>,
) -> Result<LedgerReport, InspectError> {
    let ledger = open_existing(dir, config, observer)?;
    let mut report = ledger.report()?;
    ledger.close()?;
    report.disk = Some(disk_usage(dir, report.shards)?);
    Ok(report)
}

/// The report as the table `dedupd inspect` prints.
pub fn write_table(report: &LedgerReport, mut out: impl Write) -> std::io::Result<()> {
    writeln!(out, "data dir     {}", report.data_dir.display())?;
    writeln!(out, "format       v{}", report.format_version)?;
    writeln!(out, "shards       {}", report.shards)?;
    writeln!(out, "file bytes   {}", report.file_bytes)?;
    if report.offline {
        writeln!(
            out,
            "read-only    files opened read-only; index B (memory of a running engine) not known"
        )?;
    }
    // Outcomes counted / records stored (repeats of one message share a record).
    let rows = report.subscribers.iter().map(|s| {
        vec![
            s.subscriber.to_string(),
            s.claims.to_string(),
            s.active_claims.to_string(),
            s.sealed_generations.to_string(),
            format!("{}/{}", s.quarantined, s.quarantine_records),
            format!("{}/{}", s.dead_lettered, s.dead_letter_records),
            s.filter_bytes.to_string(),
            match report.offline {
                true => "-".to_string(),
                false => s.index_bytes.to_string(),
            },
        ]
    });
    let header = [
        "subscriber",
        "claims",
        "active",
        "gens",
        "quarantined/recs",
        "dead_letter/recs",
        "filter B",
        "index B",
    ];
    write_aligned(&mut out, &header, rows)?;
    let with_state: Vec<_> = report
        .subscribers
        .iter()
        .filter(|s| s.state_runs + s.state_buffered > 0)
        .collect();
    if !with_state.is_empty() {
        writeln!(out)?;
        let rows = with_state.iter().map(|s| {
            vec![
                s.subscriber.to_string(),
                s.state_runs.to_string(),
                s.state_run_entries.to_string(),
                s.state_buffered.to_string(),
                s.state_retired_runs.to_string(),
            ]
        });
        let header = [
            "handler state",
            "runs",
            "run entries",
            "buffered",
            "retired",
        ];
        write_aligned(&mut out, &header, rows)?;
    }
    if let Some(disk) = &report.disk {
        write_disk(disk, &mut out)?;
    }
    Ok(())
}

/// Where the bytes go: one line per kind of table, then what no table accounts for.
fn write_disk(disk: &DiskUsage, mut out: impl Write) -> std::io::Result<()> {
    let share = |b: u64| format!("{:.1}%", 100.0 * b as f64 / disk.file_bytes.max(1) as f64);
    let mut rows: Vec<Vec<String>> = disk
        .groups
        .iter()
        .map(|g| {
            vec![
                g.kind.to_string(),
                g.tables.to_string(),
                g.entries.to_string(),
                g.stored_bytes.to_string(),
                g.metadata_bytes.to_string(),
                g.fragmented_bytes.to_string(),
                share(g.page_bytes()),
            ]
        })
        .collect();
    let mut free = vec![String::new(); 6];
    free[0] = "free pages, redb's own".into();
    free.push(share(disk.other_bytes));
    rows.push(free);
    writeln!(out)?;
    let header = [
        "tables (all shards)",
        "tables",
        "entries",
        "stored B",
        "metadata B",
        "fragmented B",
        "file",
    ];
    write_aligned(&mut out, &header, rows)
}

/// Rows under `header`, each column as wide as its widest cell (a subscriber name of any
/// length keeps the numbers under their heading): the first column left-aligned, the
/// others right-aligned, two spaces apart, no borders and no trailing spaces.
fn write_aligned(
    mut out: impl Write,
    header: &[&str],
    rows: impl IntoIterator<Item = Vec<String>>,
) -> std::io::Result<()> {
    let mut table = comfy_table::Table::new();
    table
        .load_style(comfy_table::presets::NOTHING)
        .set_header(header.to_vec())
        .add_rows(rows);
    for (i, column) in table.column_iter_mut().enumerate() {
        column.set_padding((if i == 0 { 0 } else { 2 }, 0));
        if i > 0 {
            column.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
    for line in table.lines() {
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// Writes `subscriber`'s handler state as JSON lines `{"key", "value"}` (and `"entity"`
/// under an entity placement, where each key is stored as `entity NUL key`).
pub fn dump_state(
    dir: &Path,
    config: &Config,
    subscriber: &str,
    out: impl Write,
) -> Result<(), InspectError> {
    let ledger = open_existing(dir, config, None)?;
    if !ledger.knows_subscriber(subscriber) {
        ledger.close()?;
        return Err(InspectError::UnknownSubscriber {
            subscriber: subscriber.to_string(),
            dir: dir.to_path_buf(),
        });
    }
    let entries = ledger.state_entries(subscriber);
    let scoped = ledger.subscriber(subscriber)?.state_per_entity();
    ledger.close()?;
    let mut out = std::io::BufWriter::new(out);
    for (k, v) in entries? {
        let line = match k.iter().position(|b| *b == 0).filter(|_| scoped) {
            Some(at) => serde_json::json!({
                "entity": readable(&k[..at]),
                "key": readable(&k[at + 1..]),
                "value": readable(&v),
            }),
            None => serde_json::json!({"key": readable(&k), "value": readable(&v)}),
        };
        writeln!(out, "{line}")?;
    }
    out.flush()?;
    Ok(())
}

/// Bytes as JSON: parsed JSON if they are JSON, a string if UTF-8, else hex
/// (`{"hex": "..."}`). How `state dump` and `handler test` show keys and values.
pub(crate) fn readable(bytes: &[u8]) -> serde_json::Value {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
        return v;
    }
    match std::str::from_utf8(bytes) {
        Ok(s) => serde_json::Value::String(s.to_string()),
        Err(_) => {
            serde_json::json!({ "hex": bytes.iter().map(|b| format!("{b:02x}")).collect::<String>() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readable_shows_json_text_and_hex() {
        assert_eq!(readable(br#"{"a":1}"#), serde_json::json!({"a": 1}));
        assert_eq!(readable(b"label"), serde_json::json!("label"));
        assert_eq!(readable(&[0xff, 0x00]), serde_json::json!({"hex": "ff00"}));
    }

    /// The table shows handler state runs and where the bytes go when the report has them.
    #[test]
    fn the_table_shows_state_runs_and_disk_use() {
        let report = LedgerReport {
            data_dir: "d".into(),
            format_version: 3,
            shards: 2,
            file_bytes: 1000,
            subscribers: vec![crate::ledger::SubscriberReport {
                subscriber: "orders".into(),
                state_runs: 3,
                state_run_entries: 1234,
                state_buffered: 7,
                ..Default::default()
            }],
            disk: Some(DiskUsage {
                groups: vec![crate::ledger::TableGroup {
                    kind: "staterun_v1".into(),
                    tables: 3,
                    entries: 40,
                    stored_bytes: 500,
                    metadata_bytes: 100,
                    fragmented_bytes: 150,
                }],
                file_bytes: 1000,
                other_bytes: 250,
            }),
            offline: true,
        };
        let mut out = Vec::new();
        write_table(&report, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let runs = text
            .lines()
            .find(|l| l.starts_with("orders") && l.contains("1234"));
        assert!(
            runs.is_some_and(
                |l| l.split_whitespace().collect::<Vec<_>>() == ["orders", "3", "1234", "7", "0"]
            ),
            "{text}"
        );
        let disk = text.lines().find(|l| l.starts_with("staterun_v1")).unwrap();
        assert!(disk.ends_with("75.0%"), "{disk}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("free pages") && l.ends_with("25.0%")),
            "{text}"
        );
        // Read from closed files: no index size, and the table says why.
        assert!(text.contains("read-only"), "{text}");
        let sub = text
            .lines()
            .find(|l| l.starts_with("orders") && !l.contains("1234"));
        assert!(sub.is_some_and(|l| l.ends_with(" -")), "{text}");
    }

    /// Columns are as wide as their widest cell: a long subscriber name used to push its
    /// row's numbers out from under their headings (the names had 24 columns).
    #[test]
    fn a_long_subscriber_name_keeps_every_number_under_its_heading() {
        let sub = |name: &str, claims: u64| crate::ledger::SubscriberReport {
            subscriber: name.into(),
            claims,
            active_claims: claims / 2,
            filter_bytes: 4096,
            ..Default::default()
        };
        let report = LedgerReport {
            data_dir: "d".into(),
            format_version: 9,
            shards: 2,
            file_bytes: 1000,
            subscribers: vec![
                sub("orders", 12),
                sub("billing-invoice-reconciliation-subscriber-eu-west", 345_678),
            ],
            disk: None,
            offline: false,
        };
        let mut out = Vec::new();
        write_table(&report, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let header = text.lines().find(|l| l.starts_with("subscriber")).unwrap();
        for (heading, values) in [("claims", ["12", "345678"]), ("active", ["6", "172839"])] {
            let end = header.find(heading).unwrap() + heading.len();
            for (row, value) in ["orders", "billing"].iter().zip(values) {
                let line = text.lines().find(|l| l.starts_with(row)).unwrap();
                assert_eq!(
                    line.get(..end).and_then(|l| l.split_whitespace().last()),
                    Some(value),
                    "{heading} of {row} not under its heading:\n{text}"
                );
            }
        }
        assert!(text.lines().all(|l| l == l.trim_end()), "{text:?}");
    }

    #[test]
    fn a_missing_data_directory_is_refused_not_created() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("typo");
        let err = inspect(&dir).unwrap_err();
        assert!(matches!(err, InspectError::NotADataDir(_)), "{err}");
        let err = inspect_repairing(&dir, &Config::default()).unwrap_err();
        assert!(matches!(err, InspectError::NotADataDir(_)), "{err}");
        assert!(!dir.exists());
    }
}
