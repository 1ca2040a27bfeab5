//! The benchmark commands: each says its parameters on stderr, runs with its progress
//! there, and prints its report as text or, with `--json`, as one JSON object.

use std::fmt::Display;

use anyhow::{bail, Result};
use serde::Serialize;

use crate::args;
use crate::output::{end_progress, progress};

/// Prints a report on stdout: its text, or one line of JSON.
fn print_report(report: &(impl Serialize + Display), json: bool) -> Result<()> {
    match json {
        true => println!("{}", serde_json::to_string(report)?),
        false => print!("{report}"),
    }
    Ok(())
}

/// `dedupd bench` (and `bench adversarial`).
pub(crate) fn engine(mut args: args::BenchArgs) -> Result<()> {
    if let Some(args::BenchCommand::Adversarial(a)) = args.command.take() {
        return adversarial(a);
    }
    let (json, series) = (args.run.json, args.series);
    let params = args.params()?;
    eprintln!("{params}");
    let report = dedupd::bench::run(&params, |p| progress(&p))?;
    end_progress();
    print_report(&report, json)?;
    for p in report.series.iter().filter(|_| series && !json) {
        let per = |bytes: u64| bytes as f64 / p.processed.max(1) as f64;
        println!(
            "series   {:>12} msgs  {:>10.0} msgs/s  {:>12} processed  resident {:>7.1} MiB  disk {:>8.1} MiB ({:>5.1} B/processed)",
            p.messages,
            p.msgs_per_sec,
            p.processed,
            p.rss_bytes as f64 / (1 << 20) as f64,
            p.disk_allocated_bytes as f64 / (1 << 20) as f64,
            per(p.disk_allocated_bytes)
        );
    }
    if !report.verified {
        bail!("outcomes did not match the generated traffic");
    }
    Ok(())
}

/// `dedupd bench adversarial`.
fn adversarial(args: args::AdversarialArgs) -> Result<()> {
    let json = args.json;
    let params = args.params()?;
    let report = dedupd::bench::run_adversarial(&params, |phase| eprintln!("== {phase}"))?;
    print_report(&report, json)?;
    if !report.verified() {
        bail!("outcomes, claims or counts differ from the traffic (lines marked PROBLEM)");
    }
    Ok(())
}

/// `dedupd kafka-bench`.
pub(crate) fn kafka(args: args::KafkaBenchArgs) -> Result<()> {
    let json = args.run.json;
    let params = args.params()?;
    eprintln!("{params}");
    let report = dedupd::source::kafka::bench::run(&params, &mut |p| progress(&p))?;
    end_progress();
    print_report(&report, json)
}

/// `dedupd mqtt-bench`.
pub(crate) fn mqtt(args: args::MqttBenchArgs) -> Result<()> {
    let json = args.run.json;
    let params = args.params()?;
    eprintln!("{params}");
    let report = dedupd::source::mqtt::bench::run(&params, &mut |phase| eprintln!("{phase}"))?;
    print_report(&report, json)
}

/// `dedupd nats-bench`.
pub(crate) fn nats(args: args::NatsBenchArgs) -> Result<()> {
    let json = args.run.json;
    let params = args.params()?;
    eprintln!("{params}");
    let report = dedupd::source::nats::bench::run(&params, &mut |phase, done, total| {
        progress(&format!("{phase}: {done}/{total}"))
    })?;
    end_progress();
    print_report(&report, json)
}

/// `dedupd rabbitmq-bench`.
pub(crate) fn rabbitmq(args: args::RabbitmqBenchArgs) -> Result<()> {
    let json = args.run.json;
    let params = args.params()?;
    eprintln!("{params}");
    let report = dedupd::source::rabbitmq::bench::run(&params, &mut |phase, done, total| {
        progress(&format!("{phase}: {done}/{total}"))
    })?;
    end_progress();
    print_report(&report, json)
}
