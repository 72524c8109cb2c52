//! Events through a message broker, the third at-least-once boundary: the
//! outbox (events written in the transaction of their change) is published
//! by the [`relay`] to a NATS JetStream stream, and the [`ledger`] consumes
//! it, applying each event once through its inbox.
//!
//! Every hop repeats on failure, so every hop may deliver twice: the relay
//! publishes again what it published but had not recorded; the broker
//! delivers again what was not acknowledged in time. Two guards answer
//! them: the stream drops a publish whose `Nats-Msg-Id` (the event's id) it
//! saw within its duplicate window, which works like a key's TTL; and the
//! consumer's inbox, which has no window, applies a message id once.

pub mod ledger;
pub mod relay;

use anyhow::Context as _;
use async_nats::jetstream::{self, stream};

use crate::config::Broker;

/// A JetStream context on the servers of `NATS_URL`.
pub async fn connect(config: &Broker) -> anyhow::Result<jetstream::Context> {
    let urls = config.nats_url.as_ref().context(
        "NATS_URL is not set: the relay and the consumer need a NATS server with JetStream",
    )?;
    let addrs = urls
        .0
        .iter()
        .map(|u| u.parse::<async_nats::ServerAddr>())
        .collect::<Result<Vec<_>, _>>()?;
    let client = async_nats::ConnectOptions::new()
        .connect(addrs)
        .await
        .context("connecting to NATS")?;
    Ok(jetstream::new(client))
}

/// The stream events go to, made when missing: every subject under the
/// prefix, kept on disk, with the configured duplicate window and replicas.
pub async fn stream(js: &jetstream::Context, config: &Broker) -> anyhow::Result<stream::Stream> {
    let wanted = stream::Config {
        name: config.stream.clone(),
        subjects: vec![format!("{}.>", config.subject_prefix)],
        storage: stream::StorageType::File,
        duplicate_window: config.duplicate_window,
        num_replicas: config.replicas,
        ..Default::default()
    };
    js.get_or_create_stream(wanted)
        .await
        .with_context(|| format!("the stream {}", config.stream))
}

/// The subject of one event: `<prefix>.<merchant id>.<event type>`, so a
/// consumer can take one merchant's events, or one type's of every merchant.
pub fn subject(config: &Broker, merchant_id: uuid::Uuid, event_type: &str) -> String {
    format!("{}.{merchant_id}.{event_type}", config.subject_prefix)
}
