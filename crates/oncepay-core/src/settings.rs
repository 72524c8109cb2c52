//! The durations the guarantee is tuned by, as the server's configuration sets them.

use std::time::Duration;

/// How long keys live, how long work may take, and how often recovery runs.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// How long a completed key is kept (`IDEMPOTENCY_KEY_TTL`).
    pub key_ttl: Duration,
    /// How long a key may stay `processing` before a retry or the sweeper
    /// may lease it and settle its record (`PROCESSING_TIMEOUT`).
    pub processing: Duration,
    /// How long a request may take before it is answered `503` (`REQUEST_TIMEOUT`).
    pub request: Duration,
    /// How often the sweeper looks for stale records (`SWEEP_INTERVAL`).
    pub sweep_interval: Duration,
}
