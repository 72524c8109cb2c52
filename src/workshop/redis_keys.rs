//! The workshop's key store outside the business transaction
//! (`POST /demo/redis/charges`), WRONG ON PURPOSE: a common design that
//! keeps idempotency keys in Redis. `SET key processing NX PX ttl` claims
//! the key, the charge commits in Postgres, then the answer is written back
//! with `SET key answer PX ttl`. Two systems, two commits: a crash between
//! them leaves the key `processing` in Redis with nothing that could ever
//! settle it. Every retry gets `409` until the TTL ends, and the first retry
//! after it charges again.
//!
//! The real key lives in the same Postgres transaction as the charge (see
//! `operation`), so the key and the business write commit together, and the
//! sweeper can settle a key a crash left behind.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use uuid::Uuid;

use oncepay_core::idempotency::SavedResponse;

/// What a claimed, unfinished key holds.
const PROCESSING: &str = "processing";

/// How long a connection or a command may take.
const TIMEOUT: Duration = Duration::from_secs(2);

/// What claiming a key in Redis found.
#[derive(Debug)]
pub enum Claim {
    /// `SET NX` took the key: it is this request's now.
    Claimed,
    /// The key holds a saved answer.
    Replay(SavedResponse),
    /// The key says `processing`, for `ttl` more (Redis's `PTTL`).
    InUse { ttl: Duration },
}

/// The Redis key of a merchant's idempotency key.
fn redis_key(merchant_id: Uuid, key: &str) -> String {
    format!("oncepay:demo:idempotency:{merchant_id}:{key}")
}

/// A connection of its own for one request (a handful a minute, in a workshop).
pub async fn connect(client: &redis::Client) -> redis::RedisResult<MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(TIMEOUT))
        .set_response_timeout(Some(TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// `SET key processing NX PX ttl`; when the key exists, what it holds.
pub async fn claim(
    conn: &mut MultiplexedConnection,
    merchant_id: Uuid,
    key: &str,
    ttl: Duration,
) -> redis::RedisResult<Claim> {
    let name = redis_key(merchant_id, key);
    // Twice at most: the key may expire between the SET and the GET.
    for _ in 0..2 {
        let set: Option<String> = redis::cmd("SET")
            .arg(&name)
            .arg(PROCESSING)
            .arg("NX")
            .arg("PX")
            .arg(millis(ttl))
            .query_async(conn)
            .await?;
        if set.is_some() {
            return Ok(Claim::Claimed);
        }
        let held: Option<String> = redis::cmd("GET").arg(&name).query_async(conn).await?;
        match held.as_deref() {
            None => continue,
            Some(PROCESSING) => {
                let ttl: i64 = redis::cmd("PTTL").arg(&name).query_async(conn).await?;
                return Ok(Claim::InUse {
                    ttl: Duration::from_millis(ttl.max(0) as u64),
                });
            }
            Some(saved) => return Ok(Claim::Replay(decode(saved)?)),
        }
    }
    Ok(Claim::InUse {
        ttl: Duration::ZERO,
    })
}

/// `SET key answer PX ttl`: the answer, for the key's retries.
pub async fn complete(
    conn: &mut MultiplexedConnection,
    merchant_id: Uuid,
    key: &str,
    saved: &SavedResponse,
    ttl: Duration,
) -> redis::RedisResult<()> {
    redis::cmd("SET")
        .arg(redis_key(merchant_id, key))
        .arg(encode(saved))
        .arg("PX")
        .arg(millis(ttl))
        .query_async(conn)
        .await
}

/// `DEL key`, after a request that charged nothing.
pub async fn release(
    conn: &mut MultiplexedConnection,
    merchant_id: Uuid,
    key: &str,
) -> redis::RedisResult<()> {
    redis::cmd("DEL")
        .arg(redis_key(merchant_id, key))
        .query_async(conn)
        .await
}

fn millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A saved answer as Redis holds it: JSON with the status, content type and
/// body (the API's bodies are JSON text).
fn encode(saved: &SavedResponse) -> String {
    serde_json::json!({
        "status": saved.status,
        "content_type": saved.content_type,
        "body": String::from_utf8_lossy(&saved.body),
    })
    .to_string()
}

fn decode(held: &str) -> redis::RedisResult<SavedResponse> {
    let bad = || {
        redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "not an answer oncepay saved",
        ))
    };
    let value: serde_json::Value = serde_json::from_str(held).map_err(|_| bad())?;
    Ok(SavedResponse {
        status: value["status"]
            .as_u64()
            .and_then(|s| u16::try_from(s).ok())
            .ok_or_else(bad)?,
        content_type: value["content_type"].as_str().ok_or_else(bad)?.to_owned(),
        location: None,
        body: value["body"]
            .as_str()
            .ok_or_else(bad)?
            .to_owned()
            .into_bytes()
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_answer_comes_back_from_redis_as_it_went_in() {
        let saved = SavedResponse {
            status: 201,
            content_type: "application/json".into(),
            location: None,
            body: br#"{"id":"ch_1","object":"charge"}"#.to_vec().into(),
        };
        let back = decode(&encode(&saved)).unwrap();
        assert_eq!(
            (back.status, back.content_type, back.body),
            (saved.status, saved.content_type, saved.body)
        );
        assert!(decode("processing").is_err());
    }
}
