//! PostgreSQL as a dedup store, the way the seeds' articles write it: a `processed_message`
//! table keyed by (subscriber, message id), `INSERT … ON CONFLICT DO NOTHING`, one row
//! counted as new, none as a duplicate. The only module that imports `tokio-postgres`.

use std::time::Instant;

use tokio_postgres::NoTls;

use super::server::{start_postgres, tree_allocated_bytes, tree_memory_bytes};
use super::{PeerRun, Workload};
use dedupd::telemetry::Latency;

/// The seeds' table, as written there.
const SCHEMA: &str = "create table processed_message (
    subscriber_id varchar(150) not null,
    message_id uuid not null,
    processed_at timestamptz not null default current_timestamp,
    primary key (subscriber_id, message_id)
)";

const INSERT_ONE: &str = "insert into processed_message (subscriber_id, message_id)
    values ($1::varchar, ($2::text)::uuid) on conflict do nothing";

const INSERT_BATCH: &str = "insert into processed_message (subscriber_id, message_id)
    select $1::varchar, m::uuid from unnest($2::text[]) as m on conflict do nothing";

/// How the clients send the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// One message per transaction (autocommit), `clients` connections in parallel.
    PerTransaction,
    /// `batch` messages per statement and transaction, one connection.
    Batched,
}

/// Starts a server, loads the workload, measures, stops the server.
pub fn run(w: &Workload, mode: Mode) -> Result<PeerRun, String> {
    let server = start_postgres(&w.dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a tokio runtime: {e}"))?;
    let conn = format!(
        "host=127.0.0.1 port={} user=dedupd dbname=postgres",
        server.port
    );
    rt.block_on(async {
        // The port opens before recovery ends ("the database system is starting up").
        let started = Instant::now();
        let admin = loop {
            match connect(&conn).await {
                Ok(c) => break c,
                Err(_) if started.elapsed() < std::time::Duration::from_secs(30) => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => return Err(e),
            }
        };
        admin.batch_execute(SCHEMA).await.map_err(pg)?;
        // Settled before the base figures: the connection, the catalog, the empty table.
        let mem_base = tree_memory_bytes(server.pid());
        let disk_base = tree_allocated_bytes(&server.data_dir);
        let clients = match mode {
            Mode::PerTransaction => w.clients.max(1),
            Mode::Batched => 1,
        };
        let start = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..clients {
            let client = connect(&conn).await?;
            let w = w.clone();
            tasks.push(tokio::spawn(async move {
                load(client, &w, mode, i, clients).await
            }));
        }
        let mut run = PeerRun::default();
        for t in tasks {
            let part = t.await.map_err(|e| format!("client task failed: {e}"))??;
            run.add(part);
        }
        run.elapsed = start.elapsed();
        let stored = admin
            .query_one("select count(*) from processed_message", &[])
            .await
            .map_err(pg)?;
        run.stored_keys = stored.get::<_, i64>(0) as u64;
        run.memory_bytes = tree_memory_bytes(server.pid()).saturating_sub(mem_base);
        run.disk_bytes = tree_allocated_bytes(&server.data_dir).saturating_sub(disk_base);
        Ok(run)
    })
}

async fn connect(conn: &str) -> Result<tokio_postgres::Client, String> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls).await.map_err(pg)?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// The server's own message when there is one (`Display` says only "db error").
fn pg(e: tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("postgres: {}: {}", db.code().code(), db.message()),
        None => format!("postgres: {e}"),
    }
}

/// One client's share: every `clients`-th message starting at `index`.
async fn load(
    client: tokio_postgres::Client,
    w: &Workload,
    mode: Mode,
    index: u32,
    clients: u32,
) -> Result<PeerRun, String> {
    let mut run = PeerRun {
        latency: Latency::default(),
        ..PeerRun::default()
    };
    match mode {
        Mode::PerTransaction => {
            let stmt = client.prepare(INSERT_ONE).await.map_err(pg)?;
            for (id, expect) in w.messages(index, clients) {
                run.expect(expect);
                let t = Instant::now();
                let n = client
                    .execute(&stmt, &[&w.subscriber, &id])
                    .await
                    .map_err(pg)?;
                run.latency.record_us(t.elapsed().as_micros() as u64);
                run.processed += n;
            }
        }
        Mode::Batched => {
            let stmt = client.prepare(INSERT_BATCH).await.map_err(pg)?;
            let mut ids: Vec<String> = Vec::with_capacity(w.batch as usize);
            let mut messages = w.messages(index, clients).peekable();
            while messages.peek().is_some() {
                ids.clear();
                for (id, expect) in messages.by_ref().take(w.batch as usize) {
                    run.expect(expect);
                    ids.push(id);
                }
                let t = Instant::now();
                let n = client
                    .execute(&stmt, &[&w.subscriber, &ids])
                    .await
                    .map_err(pg)?;
                run.latency.record_us(t.elapsed().as_micros() as u64);
                run.processed += n;
            }
        }
    }
    Ok(run)
}
