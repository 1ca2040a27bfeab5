//! The soak in its short form (issue 14, item 7; `dedupd-bench soak --minutes 2` and the
//! 30-minute run are the long forms, in `scripts/reliability`): a capacity measurement,
//! then a paced run at half of it with a 4 s TTL and small generations, so claims are
//! sealed, merged and dropped by expiry many times over. Asserts the samples are sane and
//! the bounds hold (memory, disk, claims and generations; the offered rate served); the
//! p99 criterion (a debug build on a shared machine) is printed, not asserted. The
//! verdict's own failures are shown on synthetic series.
#![allow(
    clippy::unwrap_used,
    reason = "tests: a failed unwrap is a failed test"
)]

use std::time::Duration;

use dedupd::bench::soak::{failed, judge};
use dedupd::bench::{run_soak, SoakParams, SoakSample};
use dedupd::config::Config;

#[test]
fn a_short_soak_stays_bounded_while_generations_seal_merge_and_expire() {
    let tmp = tempfile::tempdir().unwrap();
    let mut config = Config::default();
    config.ledger.shards = std::num::NonZeroUsize::new(2);
    let params = SoakParams {
        duration: Duration::from_secs(40),
        capacity_duration: Duration::from_secs(4),
        // Half, not the long forms' 70 %: the capacity is a 4 s closed loop, and when the
        // shared machine got busier after it, 70 % of it was more than the engine then had
        // (2026-12-07: offered 394k, served 322-395k, a backlog of 1M after 40 s).
        load: 0.5,
        rate: None,
        sample_every: Duration::from_secs(2),
        ttl: Duration::from_secs(4),
        generation_claims: 2_048,
        subscribers: 2,
        dup_rate: 0.1,
        seed: 7,
        window: 16_384,
        dir: tmp.path().to_path_buf(),
        config,
    };
    let report = run_soak(&params, |line| eprintln!("{line}")).unwrap();
    eprint!("{report}");
    let s = &report.samples;
    assert!(s.len() >= 15, "{} samples", s.len());
    assert!(s.windows(2).all(|w| w[0].t_s < w[1].t_s));
    assert!(s
        .iter()
        .all(|x| x.rss_bytes > 0 && x.disk_allocated_bytes > 0));
    assert!(s
        .iter()
        .all(|x| x.p99_ms.is_finite() && x.msgs_per_sec > 0.0));
    assert!(report.capacity_msgs_per_sec > 0.0);
    assert_eq!(report.other, 0);
    assert_eq!(report.processed + report.duplicates, report.messages);
    let last = s[s.len() - 1];
    assert!(
        last.seals > 10 && last.merges > 0 && last.dropped_generations > 5,
        "{last:?}"
    );
    // The curves are drawn by `dedupd-bench soak --plot` (dedupd-bench/tests/compare.rs).
    for name in [
        "samples",
        "memory bounded",
        // Failed before retiring kept up with merges (25 -> 460 MiB of files in 40 s
        // while the claims stayed flat: hundreds of retired tables queued).
        "disk bounded",
        "compaction keeps up",
        "offered rate served",
    ] {
        let c = report.checks.iter().find(|c| c.name == name).unwrap();
        assert!(c.passed, "{name}: {}", c.detail);
    }
}

fn series(rss: impl Fn(usize) -> u64) -> Vec<SoakSample> {
    (0..24)
        .map(|i| SoakSample {
            t_s: 5.0 * (i + 1) as f64,
            rss_bytes: rss(i),
            disk_allocated_bytes: 64 << 20,
            p99_ms: 3.0,
            claims: 50_000,
            sealed_generations: 5,
            seals: 1 + i as u64,
            merges: i as u64 / 4,
            dropped_generations: i as u64 / 2,
            ..Default::default()
        })
        .collect()
}

#[test]
fn the_verdict_fails_memory_that_keeps_growing_and_passes_a_plateau() {
    let minute = Duration::from_secs(60);
    // 2 MiB more every 5 s: a leak of 24 MiB/min.
    let leak = series(|i| (80 + 2 * i as u64) << 20);
    let checks = judge(&leak, 3.0, 10_000.0, minute);
    assert_eq!(failed(&checks), ["memory bounded"], "{checks:?}");
    // A warm-up then a plateau with noise is not growth.
    let plateau = series(|i| {
        (if i < 4 {
            60 + 5 * i as u64
        } else {
            80 + (i as u64 % 3)
        }) << 20
    });
    assert!(failed(&judge(&plateau, 3.0, 10_000.0, minute)).is_empty());
}
