//! Reconciliation's SQL on oncepay's database: the charges and refunds of a
//! window (and by id, for the ones whose processor operation fell in it),
//! the lock that lets one instance at a time run the periodic job, and the
//! record of its runs.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool};

use oncepay_core::charges::ChargeStatus;
use oncepay_core::refunds::RefundStatus;

/// A charge as reconciliation compares it.
#[derive(Clone, Debug)]
pub struct ChargeRow {
    pub id: String,
    pub amount: i64,
    pub currency: String,
    pub status: ChargeStatus,
    pub created_at: DateTime<Utc>,
    /// What it gave back: its succeeded refunds, and the part a capture
    /// left uncaptured (the processor counts both as refunded).
    pub amount_refunded: i64,
    /// A refund of it is pending.
    pub refund_pending: bool,
    /// Its capture is asked and not yet settled.
    pub capturing: bool,
}

/// A refund as reconciliation compares it.
#[derive(Clone, Debug)]
pub struct RefundRow {
    pub id: String,
    pub charge_id: String,
    pub amount: i64,
    pub currency: String,
    pub status: RefundStatus,
    pub created_at: DateTime<Utc>,
}

/// A `query_as!` of [`ChargeRow`]s, each charge with what its refunds and
/// its capture gave back, for the charges the `WHERE` clause `$filter` keeps (`c` is the
/// charge). A macro because sqlx checks only literal text: each expansion,
/// its filter appended, is checked against the schema like any query.
macro_rules! charge_rows {
    ($filter:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            ChargeRow,
            r#"SELECT c.id, c.amount, c.currency, c.status AS "status: ChargeStatus", c.created_at,
                  (r.refunded + CASE WHEN c.captured_at IS NOT NULL
                                     THEN c.amount - c.capture_amount ELSE 0 END)::bigint
                      AS "amount_refunded!",
                  r.pending AS "refund_pending!",
                  (c.capture_amount IS NOT NULL AND c.captured_at IS NULL) AS "capturing!"
             FROM charges c
            CROSS JOIN LATERAL (
                  SELECT coalesce(sum(amount) FILTER (WHERE status = 'succeeded'), 0)::bigint
                             AS refunded,
                         coalesce(bool_or(status = 'pending'), false) AS pending
                    FROM refunds WHERE charge_id = c.id) r
            "# + $filter,
            $($arg),+
        )
    };
}

/// A `query_as!` of [`RefundRow`]s, for the refunds the `WHERE` clause
/// `$filter` keeps (a macro for the reason [`charge_rows`] is one).
macro_rules! refund_rows {
    ($filter:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            RefundRow,
            r#"SELECT id, charge_id, amount, currency, status AS "status: RefundStatus", created_at
             FROM refunds "# + $filter,
            $($arg),+
        )
    };
}

/// Which of oncepay's charges and refunds reconciliation reads.
#[derive(Clone, Copy, Debug)]
pub enum Pick<'a> {
    /// Those created in `[from, until)`.
    CreatedIn(DateTime<Utc>, DateTime<Utc>),
    /// The charges among the first ids, and the refunds among the second.
    Ids(&'a [String], &'a [String]),
}

/// The charges and the refunds `pick` names, the charges read first.
pub async fn records(
    pool: &PgPool,
    pick: Pick<'_>,
) -> sqlx::Result<(Vec<ChargeRow>, Vec<RefundRow>)> {
    // Each expansion is a type of its own: each arm reads its own two.
    Ok(match pick {
        Pick::CreatedIn(from, until) => (
            charge_rows!(
                "WHERE c.created_at >= $1 AND c.created_at < $2",
                from,
                until
            )
            .fetch_all(pool)
            .await?,
            refund_rows!("WHERE created_at >= $1 AND created_at < $2", from, until)
                .fetch_all(pool)
                .await?,
        ),
        Pick::Ids(charges, refunds) => (
            charge_rows!("WHERE c.id = ANY($1)", charges)
                .fetch_all(pool)
                .await?,
            refund_rows!("WHERE id = ANY($1)", refunds)
                .fetch_all(pool)
                .await?,
        ),
    })
}

/// The advisory lock the periodic job holds while it runs ("reconcil" in
/// ASCII): whoever holds it is the one instance reconciling.
pub const LOCK: i64 = 0x7265_636f_6e63_696c;

/// Takes the job's lock for this session, unless another holds it; whether
/// it did. A session that ends (a crash, a closed connection) lets it go.
pub async fn try_lock(conn: &mut PgConnection) -> sqlx::Result<bool> {
    sqlx::query_scalar!(r#"SELECT pg_try_advisory_lock($1) AS "locked!""#, LOCK)
        .fetch_one(conn)
        .await
}

/// Lets the job's lock go.
pub async fn unlock(conn: &mut PgConnection) -> sqlx::Result<()> {
    sqlx::query_scalar!(r#"SELECT pg_advisory_unlock($1) AS "unlocked!""#, LOCK)
        .fetch_one(conn)
        .await?;
    Ok(())
}

/// Whether no run began within `within` of now.
pub async fn due(db: impl PgExecutor<'_>, within: Duration) -> sqlx::Result<bool> {
    sqlx::query_scalar!(
        r#"SELECT NOT EXISTS (
               SELECT 1 FROM reconcile_runs
                WHERE started_at > now() - $1::float8 * interval '1 millisecond') AS "due!""#,
        within.as_millis() as f64,
    )
    .fetch_one(db)
    .await
}

/// A finished run, as recorded.
#[derive(Debug)]
pub struct Run<'a> {
    pub started_at: DateTime<Utc>,
    pub window_from: DateTime<Utc>,
    pub window_until: DateTime<Utc>,
    pub differences: i32,
    pub by_kind: &'a serde_json::Value,
}

/// Records a finished run.
pub async fn record_run(db: impl PgExecutor<'_>, run: &Run<'_>) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO reconcile_runs (started_at, window_from, window_until, differences, by_kind)
         VALUES ($1, $2, $3, $4, $5::text::jsonb)",
        run.started_at,
        run.window_from,
        run.window_until,
        run.differences,
        run.by_kind.to_string(),
    )
    .execute(db)
    .await?;
    Ok(())
}
