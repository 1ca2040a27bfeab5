//! The commands that are more than a library call and a print: `handler check/test/new`,
//! `inspect`, `backup`, `restore`, `dev-broker`, `demo` (the benchmarks are in
//! `benches.rs`).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::args::{self, load_config};
use crate::output::{end_progress, progress, CopyProgress};
use dedupd::pipeline;
use dedupd::source::kafka;

/// `dedupd handler check|test|new`.
pub(crate) fn handler(command: args::HandlerCommand) -> Result<()> {
    match command {
        args::HandlerCommand::Check { file, json } => {
            let component = dedupd::handler::Component::load(&file, Default::default())?;
            match json {
                true => println!("{}", serde_json::to_string_pretty(component.report())?),
                false => print!("{}", component.report()),
            }
        }
        args::HandlerCommand::Test(args) => handler_test(args)?,
        args::HandlerCommand::New { name, lang, dir } => {
            let project = dedupd::scaffold::create(&dir, &name, lang.parse()?)?;
            println!(
                "created {} ({} files)\n\nnext:\n{}",
                project.dir.display(),
                project.files.len(),
                project.next_steps()
            );
        }
    }
    Ok(())
}

/// `dedupd inspect`; with `repair` (the config file it names, if any) `--repair`, with
/// its progress at a terminal.
pub(crate) fn inspect(data_dir: &Path, repair: Option<Option<&Path>>, json: bool) -> Result<()> {
    let report = match repair {
        None => dedupd::inspect::inspect(data_dir)?,
        Some(config) => {
            let config = load_config(config)?;
            let shown = crate::repair_progress::RepairProgress::new(data_dir);
            let report =
                dedupd::inspect::inspect_repairing_observed(data_dir, &config, shown.observer());
            shown.finish();
            report?
        }
    };
    match json {
        true => println!("{}", serde_json::to_string_pretty(&report)?),
        false => dedupd::inspect::write_table(&report, std::io::stdout().lock())?,
    }
    Ok(())
}

/// `dedupd backup`, with its progress at a terminal.
pub(crate) fn backup(data_dir: &Path, to: &Path, json: bool) -> Result<()> {
    let report = {
        let mut shown = CopyProgress::new();
        dedupd::backup::backup_offline(data_dir, to, &mut |p| shown.observe(p))?
    };
    match json {
        true => println!("{}", serde_json::to_string_pretty(&report)?),
        false => println!(
            "backup {}: {} files, {} bytes, checksums in {}",
            to.display(),
            report.manifest.files.len(),
            report.bytes,
            dedupd::backup::BACKUP_MANIFEST
        ),
    }
    Ok(())
}

/// `dedupd handler test`.
fn handler_test(args: args::HandlerTestArgs) -> Result<()> {
    use dedupd::harness;
    if !args.file.exists() {
        bail!("handler {} not found", args.file.display());
    }
    let messages = harness::read_messages(&args.input)?;
    let seed = match &args.state {
        Some(p) => harness::read_state(p)?,
        None => harness::Seed::default(),
    };
    let expected = match &args.expect {
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", p.display()))?,
        ),
        None => None,
    };
    let options = harness::Options {
        component: args.file,
        config: load_config(args.config.as_deref())?,
        subscriber: args.subscriber,
        now_ms: args.now_ms,
        cpu_budget: args.cpu_budget,
    };
    let reports = harness::run(&options, &messages, &seed)?;
    if let (Some(path), Some(expected)) = (&args.expect, expected) {
        let file = path.display().to_string();
        match harness::compare(&file, &expected, &reports) {
            Ok(n) => println!("ok: {n} messages as expected in {file}"),
            Err(diff) => {
                eprint!("{diff}");
                bail!("the output differs from {file}");
            }
        }
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    match args.json {
        true => out.write_all(harness::json_lines(&reports).as_bytes())?,
        false => harness::write_human(&reports, &mut out)?,
    }
    out.flush()?;
    Ok(())
}

/// `dedupd restore`: verify only (no data directory), or verify, restore and load.
pub(crate) fn restore(from: &std::path::Path, data_dir: Option<PathBuf>, json: bool) -> Result<()> {
    let Some(data_dir) = data_dir else {
        let mut shown = CopyProgress::new();
        let manifest = dedupd::backup::verify_observed(from, &mut |p| shown.observe(p));
        drop(shown);
        let manifest = manifest.with_context(|| {
            format!(
                "{} is not a sound backup; nothing would be restored",
                from.display()
            )
        })?;
        match json {
            true => println!("{}", serde_json::to_string_pretty(&manifest)?),
            false => println!(
                "backup {}: {} files verified (taken {}, dedupd {})",
                from.display(),
                manifest.files.len(),
                if manifest.online { "online" } else { "offline" },
                manifest.dedupd_version
            ),
        }
        return Ok(());
    };
    let mut shown = CopyProgress::new();
    let restored = dedupd::backup::restore_observed(from, &data_dir, &mut |p| shown.observe(p));
    drop(shown);
    let (manifest, report) =
        restored.with_context(|| format!("nothing was restored into {}", data_dir.display()))?;
    match json {
        true => println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"backup": manifest, "restored": report})
            )?
        ),
        false => {
            println!(
                "restored {} files from {} into {}; it opens read-only:",
                manifest.files.len(),
                from.display(),
                data_dir.display()
            );
            dedupd::inspect::write_table(&report, std::io::stdout().lock())?;
        }
    }
    Ok(())
}

pub(crate) fn dev_broker(brokers: i32, topics: &[String]) -> Result<()> {
    let shutdown = pipeline::Shutdown::new();
    shutdown.on_signals()?;
    let broker = kafka::DevBroker::start(brokers)?;
    for t in topics {
        let (name, partitions) = args::topic(t)?;
        broker.create_topic(name, partitions)?;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", broker.bootstrap_servers())?;
    out.flush()?;
    drop(out);
    eprintln!(
        "dedupd dev-broker: mock Kafka cluster at {} (in memory; stop with Ctrl-C)",
        broker.bootstrap_servers()
    );
    shutdown.wait();
    Ok(())
}

pub(crate) fn demo(messages: u64, handler: Option<PathBuf>) -> Result<()> {
    eprintln!("dedupd demo: {messages} OrderPlaced events for 3 subscribers, 12% redeliveries, 0.2% reused ids with other payloads, 2% new events for an order seen before; durable commits on a temporary data directory");
    match &handler {
        Some(h) => eprintln!("handler: {} (one shipping label per order)", h.display()),
        None => eprintln!("handler: none (claims only)"),
    }
    let report = dedupd::demo::run(messages, PathBuf::from("."), handler, |p| progress(&p))?;
    end_progress();
    print!("{report}");
    if !report.holds() {
        bail!("the demo saw a wrong outcome");
    }
    Ok(())
}
