//! The `dedupd` command line: parse (`args.rs`), load config, init tracing (`output.rs`),
//! run a library entry point, print; the longer commands are in `commands.rs`. Only the
//! binary uses anyhow.

mod args;
mod benches;
mod commands;
mod output;
mod repair_progress;

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;

use args::{data_dir, load_config, Cli, Command, ConfigCommand, StateCommand};
use commands::{backup, demo, dev_broker, handler, inspect, restore};
use dedupd::pipeline::{self, Mode, Summary};
use output::init_logs;

/// Shard writers free what sources allocate (ids, payloads, batches); mimalloc handles that
/// cross-thread pattern with far less contention than glibc malloc (measured in the bench).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (its index in `mi_option_t`; libmimalloc-sys names only
/// some options).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory committed for 10 s instead of mimalloc's default 1 s before giving it
/// back to the OS. Shards free and reallocate batch-sized buffers continuously; with the
/// default, those pages were purged and faulted back in (as zeroed transparent huge pages)
/// all the time: 5,000-8,000 faults and 10-12 % more CPU per million shipping-label messages,
/// ~1,000 faults with this setting (`perf stat -e page-faults,task-clock dedupd bench ...`).
/// Memory is still returned when idle.
fn tune_allocator() {
    // SAFETY: `mi_option_set` only stores an integer in mimalloc's option table; the index
    // is `mi_option_purge_delay` of the bundled mimalloc v3 header, and any value is valid.
    #[allow(unsafe_code, reason = "mimalloc's option table; see SAFETY")]
    unsafe {
        libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 10_000);
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    init_logs(cli.log_format, &cli.command);
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dedupd: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each said once: many of our errors name their cause in their
/// own text already (`cannot read config file x.toml: No such file...`), and anyhow's
/// alternate form would repeat it after a colon.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Pipe {
            data_dir: dir,
            config,
        } => {
            let config = load_config(config.as_deref())?;
            pipeline::run(&config, &data_dir(dir, &config)?, Mode::Pipe)?;
        }
        Command::Run {
            config,
            data_dir: dir,
            metrics_bind,
        } => {
            let mut config = load_config(Some(&config))?;
            if let Some(bind) = metrics_bind {
                config.metrics = Some(dedupd::config::MetricsConfig { bind });
            }
            let summary = pipeline::run(&config, &data_dir(dir, &config)?, Mode::of(&config))?;
            match summary {
                Summary::Kafka(kafka) => println!("{}", serde_json::json!({ "kafka": kafka })),
                Summary::Nats(nats) => println!("{}", serde_json::json!({ "nats": nats })),
                Summary::Mqtt(mqtt) => println!("{}", serde_json::json!({ "mqtt": mqtt })),
                Summary::RabbitMq(r) => println!("{}", serde_json::json!({ "rabbitmq": r })),
                _ => {}
            }
        }
        Command::Serve {
            config,
            data_dir: dir,
            bind,
        } => {
            let config = load_config(config.as_deref())?;
            let mut http = config.http.clone().unwrap_or_default();
            http.bind = bind.unwrap_or(http.bind);
            let mode = Mode::Serve { http, stdin: false };
            pipeline::run(&config, &data_dir(dir, &config)?, mode)?;
        }
        Command::Config {
            command: ConfigCommand::Check { file, json },
        } => {
            let report = pipeline::check_file(&file)?;
            match json {
                true => println!("{}", serde_json::to_string_pretty(&report)?),
                false => print!("{report}"),
            }
        }
        Command::Handler { command } => handler(command)?,
        Command::State {
            command:
                StateCommand::Dump {
                    data_dir,
                    subscriber,
                    config,
                },
        } => {
            let config = load_config(config.as_deref())?;
            dedupd::inspect::dump_state(&data_dir, &config, &subscriber, std::io::stdout().lock())?;
        }
        Command::Inspect {
            data_dir,
            repair,
            config,
            json,
        } => inspect(&data_dir, repair.then_some(config.as_deref()), json)?,
        Command::Backup { data_dir, to, json } => backup(&data_dir, &to, json)?,
        Command::Restore {
            from,
            data_dir,
            check,
            json,
        } => restore(&from, data_dir.filter(|_| !check), json)?,
        Command::DevBroker { brokers, topics } => dev_broker(brokers, &topics)?,
        Command::Version => println!("dedupd {}", dedupd::version_text()),
        Command::Completions { shell } => {
            let mut cmd = <args::Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut cmd, "dedupd", &mut std::io::stdout());
        }
        Command::Man => {
            let cmd = <args::Cli as clap::CommandFactory>::command();
            clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?;
        }
        Command::Demo { messages, handler } => demo(messages, args::demo_handler(&handler)?)?,
        Command::Bench(args) => benches::engine(*args)?,
        Command::MqttBench(args) => benches::mqtt(args)?,
        Command::KafkaBench(args) => benches::kafka(args)?,
        Command::NatsBench(args) => benches::nats(args)?,
        Command::RabbitmqBench(args) => benches::rabbitmq(args)?,
    }
    Ok(())
}
