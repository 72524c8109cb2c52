//! The gateway's SQL, on its own database: the `operations` ledger. One
//! row per account and idempotency key, inserted once (`ON CONFLICT DO
//! NOTHING`): the first writer under a key wins, and everyone after reads
//! its row. Every statement names the account: no call sees another's rows.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

/// A row of the ledger, with what its refunds gave back when it is a payment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    pub key: String,
    /// `authorization`, `void`, `refund` or `capture`.
    pub kind: String,
    /// `succeeded` or `declined` (an authorization), `voided`, `refunded`
    /// or `refund_failed` (a refund), `captured`.
    pub outcome: String,
    pub amount: Option<i64>,
    pub currency: Option<String>,
    pub source: Option<String>,
    pub decline_code: Option<String>,
    /// The payment a refund or a capture is of.
    pub payment_key: Option<String>,
    /// An authorization that holds its amount until a capture takes it.
    pub capture_later: bool,
    pub created: DateTime<Utc>,
    /// For a payment: what its capture took, if it was captured later.
    pub amount_captured: Option<i64>,
    /// For a payment: how many refunds of it went through, and what went
    /// back to the card: their sum, and what a partial capture left.
    pub refunds: i64,
    pub amount_refunded: i64,
}

/// What an authorization records.
#[derive(Debug)]
pub struct NewAuthorization<'a> {
    pub key: &'a str,
    pub outcome: &'a str,
    pub amount: i64,
    pub currency: &'a str,
    pub source: &'a str,
    pub decline_code: Option<&'a str>,
    pub capture_later: bool,
}

/// Records an authorization unless the key holds something: the row
/// written, or `None` when the key held one already (read it with [`find`]).
/// One statement: a fresh authorization has no refunds yet.
pub async fn insert_authorization(
    db: impl PgExecutor<'_>,
    account: &str,
    new: &NewAuthorization<'_>,
) -> sqlx::Result<Option<Operation>> {
    sqlx::query_as!(
        Operation,
        r#"INSERT INTO operations (account, key, kind, outcome, amount, currency, source,
                                   decline_code, capture_later)
           VALUES ($1, $2, 'authorization', $3, $4, $5, $6, $7, $8)
           ON CONFLICT (account, key) DO NOTHING
           RETURNING key, kind, outcome, amount, currency, source, decline_code, payment_key,
                     capture_later, created, NULL::bigint AS amount_captured,
                     0::bigint AS "refunds!", 0::bigint AS "amount_refunded!""#,
        account,
        new.key,
        new.outcome,
        new.amount,
        new.currency,
        new.source,
        new.decline_code,
        new.capture_later,
    )
    .fetch_optional(db)
    .await
}

/// Records a void unless the key holds something; whether it did.
pub async fn insert_void(db: impl PgExecutor<'_>, account: &str, key: &str) -> sqlx::Result<bool> {
    let done = sqlx::query!(
        "INSERT INTO operations (account, key, kind, outcome) VALUES ($1, $2, 'void', 'voided')
         ON CONFLICT (account, key) DO NOTHING",
        account,
        key,
    )
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A `query_as!` of [`Operation`]s, each with what its capture took and its
/// refunds gave back, for the rows the `WHERE` clause `$filter` keeps (`o` is the operation).
/// A macro because sqlx checks only literal text: each expansion, its filter
/// appended, is checked against the schema like any query.
macro_rules! operations {
    ($filter:literal, $($arg:expr),+ $(,)?) => {
        sqlx::query_as!(
            Operation,
            r#"SELECT o.key, o.kind, o.outcome, o.amount, o.currency, o.source, o.decline_code,
                  o.payment_key, o.capture_later, o.created,
                  c.amount AS "amount_captured?", r.refunds AS "refunds!",
                  (r.refunded + coalesce(o.amount - c.amount, 0))::bigint AS "amount_refunded!"
             FROM operations o
             CROSS JOIN LATERAL (
                   SELECT count(*) AS refunds, coalesce(sum(x.amount), 0)::bigint AS refunded
                     FROM operations x
                    WHERE x.account = o.account AND x.payment_key = o.key
                      AND x.outcome = 'refunded') r
             LEFT JOIN operations c
                    ON c.account = o.account AND c.payment_key = o.key AND c.kind = 'capture'
            "# + $filter,
            $($arg),+
        )
    };
}

/// The operation `account` recorded under `key`.
pub async fn find(
    db: impl PgExecutor<'_>,
    account: &str,
    key: &str,
) -> sqlx::Result<Option<Operation>> {
    operations!("WHERE o.account = $1 AND o.key = $2", account, key)
        .fetch_optional(db)
        .await
}

/// A page of `account`'s ledger in `[from, until)`, oldest first (by `created`,
/// then key), after the operation `after` when given: at most `limit` rows.
pub async fn list(
    db: impl PgExecutor<'_>,
    account: &str,
    from: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    after: Option<&Operation>,
    limit: i64,
) -> sqlx::Result<Vec<Operation>> {
    let (after_created, after_key) = after.map(|o| (o.created, o.key.as_str())).unzip();
    operations!(
        "WHERE o.account = $1
              AND o.created >= coalesce($2, '-infinity'::timestamptz)
              AND o.created < coalesce($3, 'infinity'::timestamptz)
              AND ($4::timestamptz IS NULL OR (o.created, o.key) > ($4, $5::text))
            ORDER BY o.created, o.key
            LIMIT $6",
        account,
        from,
        until,
        after_created,
        after_key,
        limit,
    )
    .fetch_all(db)
    .await
}

/// `account`'s payment `key`, locked until the transaction ends, so
/// refunds and captures of it are checked one after the other.
pub async fn lock_payment(
    tx: &mut PgConnection,
    account: &str,
    key: &str,
) -> sqlx::Result<Option<Operation>> {
    sqlx::query!(
        "SELECT key FROM operations WHERE account = $1 AND key = $2 FOR UPDATE",
        account,
        key
    )
    .fetch_optional(&mut *tx)
    .await?;
    find(&mut *tx, account, key).await
}

/// How many refunds of `payment_key` were recorded, failed ones included.
pub async fn refund_attempts(
    tx: &mut PgConnection,
    account: &str,
    payment_key: &str,
) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM operations
            WHERE account = $1 AND payment_key = $2 AND kind = 'refund'"#,
        account,
        payment_key,
    )
    .fetch_one(tx)
    .await
}

/// What a refund records.
#[derive(Debug)]
pub struct NewRefund<'a> {
    pub key: &'a str,
    pub payment_key: &'a str,
    pub outcome: &'a str,
    pub amount: i64,
    pub currency: &'a str,
}

/// Records a refund unless the key holds something; whether it did.
pub async fn insert_refund(
    tx: &mut PgConnection,
    account: &str,
    new: &NewRefund<'_>,
) -> sqlx::Result<bool> {
    let done = sqlx::query!(
        "INSERT INTO operations (account, key, kind, outcome, amount, currency, payment_key)
         VALUES ($1, $2, 'refund', $3, $4, $5, $6)
         ON CONFLICT (account, key) DO NOTHING",
        account,
        new.key,
        new.outcome,
        new.amount,
        new.currency,
        new.payment_key,
    )
    .execute(tx)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// What a capture records.
#[derive(Debug)]
pub struct NewCapture<'a> {
    pub key: &'a str,
    pub payment_key: &'a str,
    pub amount: i64,
    pub currency: &'a str,
}

/// Records a capture unless the key holds something; whether it did. The
/// unique index on a payment's capture refuses a second one under another
/// key (the caller checks first, with the payment locked).
pub async fn insert_capture(
    tx: &mut PgConnection,
    account: &str,
    new: &NewCapture<'_>,
) -> sqlx::Result<bool> {
    let done = sqlx::query!(
        "INSERT INTO operations (account, key, kind, outcome, amount, currency, payment_key)
         VALUES ($1, $2, 'capture', 'captured', $3, $4, $5)
         ON CONFLICT (account, key) DO NOTHING",
        account,
        new.key,
        new.amount,
        new.currency,
        new.payment_key,
    )
    .execute(tx)
    .await?;
    Ok(done.rows_affected() == 1)
}
