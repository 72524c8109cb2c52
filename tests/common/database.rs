//! A database of a test's own, shared by the test binaries (`tests/api`,
//! `tests/chaos`): created fresh, dropped when the test passes, kept (and
//! named) when it fails, for a look.

// Each test binary uses part of this module.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

pub struct TestDb {
    pub name: String,
    pub url: String,
    admin_url: String,
}

impl TestDb {
    /// A database on `DATABASE_URL`'s server, migrated.
    pub async fn create() -> Self {
        let db = Self::create_empty_on(&admin_url()).await;
        let pool = db.pool().await;
        oncepay::db::migrate(&pool)
            .await
            .expect("migrate the test database");
        pool.close().await;
        db
    }

    /// An empty database on `DATABASE_URL`'s server (a server will migrate it).
    pub async fn create_empty() -> Self {
        Self::create_empty_on(&admin_url()).await
    }

    /// An empty database on the server of `admin_url`.
    pub async fn create_empty_on(admin_url: &str) -> Self {
        // The creation time in the name lets scripts/test clear databases that
        // failed tests left behind long ago, and only those.
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let name = format!("oncepay_test_{created}_{}", Uuid::new_v4().simple());
        let mut admin = match PgConnection::connect(admin_url).await {
            Ok(admin) => admin,
            Err(e) => no_database(admin_url, e),
        };
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .expect("create the test database");
        admin.close().await.ok();
        TestDb {
            url: with_database(admin_url, &name),
            admin_url: admin_url.to_owned(),
            name,
        }
    }

    pub async fn pool(&self) -> PgPool {
        PgPool::connect(&self.url)
            .await
            .expect("connect to the test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "test failed; its database {} (and {0}_processor, if any) is kept for a look",
                self.name
            );
            return;
        }
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        // Drop runs inside the test's runtime: use a thread with its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                if let Ok(mut admin) = PgConnection::connect(&admin_url).await {
                    // With the card gateway's ledger a process test's
                    // processor made beside it, if any.
                    for name in [name.clone(), format!("{name}_processor")] {
                        let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                        let _ = sqlx::query(&drop).execute(&mut admin).await;
                    }
                }
            });
        })
        .join();
    }
}

/// The server the tests make their databases on: `DATABASE_URL`, else the
/// local Postgres that scripts/test looks for first.
fn admin_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| LOCAL_POSTGRES.to_owned())
}

/// Where a machine set up as the README says has its Postgres.
const LOCAL_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Fails a test that found no Postgres to make its database on. The first
/// such failure says why and what to do; the others only point at it, so a
/// run without a database explains itself once, not once per test.
fn no_database(admin_url: &str, e: sqlx::Error) -> ! {
    static EXPLAINED: AtomicBool = AtomicBool::new(false);
    if EXPLAINED.swap(true, Ordering::SeqCst) {
        panic!("no Postgres for the test databases (another failing test says why)");
    }
    panic!(
        "no Postgres for the test databases at {}: {e}\n\
         Set DATABASE_URL to a server where the user may create databases, for example\n  \
         DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo test --test api\n\
         or run scripts/test, which finds or starts one.",
        oncepay::config::redact_url(admin_url)
    )
}

/// Replaces the database name of a `postgres://` URL.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let base = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{name}?{q}"),
        None => format!("{base}/{name}"),
    }
}

/// `count` events of `merchant_id` written straight into the outbox, each
/// `charge.updated` (a backlog, as a relay down for a while leaves one).
pub async fn write_backlog(pool: &PgPool, merchant_id: Uuid, count: i32) {
    sqlx::query(
        "INSERT INTO events (id, merchant_id, type, object_id, data)
         SELECT 'evt_' || lpad(n::text, 24, '0'), $1, 'charge.updated', 'ch_backlog' || n,
                json_build_object('object', json_build_object('id', 'ch_backlog' || n))
           FROM generate_series(1, $2) n",
    )
    .bind(merchant_id)
    .bind(count)
    .execute(pool)
    .await
    .expect("write a backlog of events");
}
