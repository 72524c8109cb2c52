//! oncepay's account's ledger at the gateway, read over HTTP for
//! reconciliation: `GET /v1/operations` a page at a time, oldest first, and
//! `GET /v1/operations/{key}`, each under `PROCESSOR_API_KEY` (the gateway
//! shows an account its own operations only). Reads move nothing, so a read that fails
//! transiently is simply repeated.

use std::time::Duration;

use anyhow::{Context, anyhow};
use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use serde::Deserialize;

use super::HttpSettings;

/// The most a page holds at the gateway.
const PAGE: usize = 1000;

/// Attempts of one read before giving up.
const ATTEMPTS: u32 = 3;

/// One operation of the processor's ledger, as the gateway lists it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct LedgerOperation {
    /// The caller's idempotency key: `auth:<charge id>`, `refund:<refund id>`, ...
    pub key: String,
    /// `authorization`, `void` or `refund`.
    pub kind: String,
    /// `succeeded`, `declined`, `voided`, `refunded` or `refund_failed`.
    pub outcome: String,
    pub amount: Option<i64>,
    pub currency: Option<String>,
    /// The payment a refund gives money back from.
    pub payment: Option<String>,
    /// For a payment: what its refunds that went through gave back.
    #[serde(default)]
    pub amount_refunded: i64,
    /// When the gateway recorded it, in whole seconds.
    #[serde(with = "chrono::serde::ts_seconds")]
    pub created: DateTime<Utc>,
}

impl LedgerOperation {
    /// Whether this operation took money from a card.
    pub fn moved_money(&self) -> bool {
        self.kind == "authorization" && self.outcome == "succeeded"
    }

    /// Whether this operation gave money back.
    pub fn refunded(&self) -> bool {
        self.kind == "refund" && self.outcome == "refunded"
    }
}

#[derive(Deserialize)]
struct Page {
    data: Vec<LedgerOperation>,
    has_more: bool,
    next_starting_after: Option<String>,
}

/// A reader of the gateway's ledger.
#[derive(Clone, Debug)]
pub struct LedgerClient {
    client: reqwest::Client,
    base: String,
    timeout: Duration,
}

impl LedgerClient {
    /// A reader of the gateway at `settings.url`, each read within
    /// `settings.timeout`.
    pub fn new(settings: &HttpSettings) -> anyhow::Result<Self> {
        let client = reqwest::Client::builder()
            .connect_timeout(settings.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .default_headers(settings.authorization()?)
            .build()?;
        Ok(LedgerClient {
            client,
            base: settings.url.trim_end_matches('/').to_owned(),
            timeout: settings.timeout,
        })
    }

    /// Every operation the gateway recorded in `[from, until)`, oldest
    /// first, read a page at a time. The gateway filters by whole seconds:
    /// the bounds' fractions are dropped.
    pub async fn list(
        &self,
        from: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> anyhow::Result<Vec<LedgerOperation>> {
        let mut all = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut query = vec![
                ("created[gte]", from.timestamp().to_string()),
                ("created[lt]", until.timestamp().to_string()),
                ("limit", PAGE.to_string()),
            ];
            if let Some(after) = &after {
                query.push(("starting_after", after.clone()));
            }
            let url = format!(
                "{}/v1/operations?{}",
                self.base,
                form_urlencoded::Serializer::new(String::new())
                    .extend_pairs(&query)
                    .finish()
            );
            let body = self
                .get(&url)
                .await?
                .context("the processor's ledger list answered 404")?;
            let page: Page = serde_json::from_slice(&body)
                .context("reading a page of the processor's ledger")?;
            all.extend(page.data);
            match (page.has_more, page.next_starting_after) {
                (true, Some(next)) => after = Some(next),
                _ => break,
            }
        }
        Ok(all)
    }

    /// The operation under `key`, or `None` when the gateway has none.
    pub async fn find(&self, key: &str) -> anyhow::Result<Option<LedgerOperation>> {
        let url = format!(
            "{}/v1/operations/{}",
            self.base,
            percent_encoding::utf8_percent_encode(key, percent_encoding::NON_ALPHANUMERIC)
        );
        match self.get(&url).await? {
            None => Ok(None),
            Some(body) => {
                Ok(Some(serde_json::from_slice(&body).with_context(|| {
                    format!("reading the processor's operation {key:?}")
                })?))
            }
        }
    }

    /// The body of a `200`, `None` for a `404`, repeating transient failures.
    async fn get(&self, url: &str) -> anyhow::Result<Option<bytes::Bytes>> {
        let mut last = None;
        for attempt in 0..ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
            }
            let response = match self.client.get(url).timeout(self.timeout).send().await {
                Ok(response) => response,
                Err(e) => {
                    last = Some(anyhow::Error::new(e));
                    continue;
                }
            };
            let status = response.status();
            let body = match response.bytes().await {
                Ok(body) => body,
                Err(e) => {
                    last = Some(anyhow::Error::new(e));
                    continue;
                }
            };
            match status {
                s if s.is_success() => return Ok(Some(body)),
                StatusCode::NOT_FOUND => return Ok(None),
                s if s.is_server_error() => {
                    last = Some(anyhow!("{s}: {}", String::from_utf8_lossy(&body)));
                }
                s => {
                    return Err(anyhow!(
                        "the processor refused the read: {s}: {}",
                        String::from_utf8_lossy(&body)
                    ));
                }
            }
        }
        Err(last
            .unwrap_or_else(|| anyhow!("no attempt made"))
            .context(format!("reading {url} from the processor's ledger")))
    }
}
