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
pub mod settings;
pub mod watch;

use anyhow::Context as _;
use std::fmt::Debug;
use std::time::Duration;

use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind};
use async_nats::jetstream::{self, ErrorCode, stream};

use crate::config::Broker;
use settings::Changes;

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
    let context = jetstream::context::ContextBuilder::new()
        .max_ack_inflight(relay::ACKS_IN_FLIGHT)
        .build(client);
    Ok(context)
}

/// The stream events go to, made when missing, or brought to the
/// configuration when it exists: every subject under the prefix, kept on
/// disk until deleted by hand (no age, count or size limit), with the
/// configured duplicate window and replicas. A setting JetStream cannot
/// change on a stream (its storage, its retention policy) is an error that
/// names it, and nothing starts: a relay must never publish into a stream
/// that drops events in its own way.
pub async fn stream(js: &jetstream::Context, config: &Broker) -> anyhow::Result<stream::Stream> {
    let wanted = stream::Config {
        name: config.stream.clone(),
        subjects: vec![format!("{}.>", config.subject_prefix)],
        storage: stream::StorageType::File,
        duplicate_window: config.duplicate_window,
        num_replicas: config.replicas,
        ..Default::default()
    };
    let context = || format!("the stream {}", config.stream);
    let mut existing = match js.get_stream(&config.stream).await {
        Ok(existing) => existing,
        Err(e) if missing(&e) => {
            tracing::info!(stream = %config.stream, "making the stream");
            return js.create_stream(wanted).await.with_context(context);
        }
        Err(e) => return Err(e).with_context(context),
    };
    let has = existing.info().await.with_context(context)?.config.clone();
    let changes = stream_changes(&has, &wanted);
    if changes.is_empty() {
        return Ok(existing);
    }
    changes.refuse_fixed(
        format!("the stream {}", config.stream),
        "set NATS_STREAM to another stream, or delete this one and rewind the relay \
         (docs/broker.md#events-the-stream-lost)",
    )?;
    tracing::warn!(stream = %config.stream, %changes, "the stream's settings differ from the configuration: updating them");
    js.update_stream(updated(has, &wanted))
        .await
        .with_context(|| format!("updating the stream {} ({changes})", config.stream))?;
    js.get_stream(&config.stream).await.with_context(context)
}

/// Whether the broker said there is no such stream.
fn missing(e: &GetStreamError) -> bool {
    let code = match e.kind() {
        GetStreamErrorKind::JetStream(e) => e.error_code(),
        _ => return false,
    };
    code == ErrorCode::STREAM_NOT_FOUND
}

/// Each setting of the stream the relay relies on, against the wanted.
fn stream_changes(has: &stream::Config, wants: &stream::Config) -> Changes {
    let (h, w) = (has, wants);
    let mut changes = Changes::default();
    let mut compare = |setting, has: &dyn Debug, wants: &dyn Debug, fixed| {
        changes.compare(setting, format!("{has:?}"), format!("{wants:?}"), fixed);
    };
    // What the relay cannot publish through: a stream on other storage or
    // retention, one that takes no publish acks, sealed, or a copy of others.
    compare("storage", &h.storage, &w.storage, true);
    compare("retention", &h.retention, &w.retention, true);
    compare("no_ack", &h.no_ack, &false, true);
    compare("sealed", &h.sealed, &false, true);
    compare("mirror", &h.mirror.is_some(), &false, true);
    let sourced = h.sources.as_ref().is_some_and(|s| !s.is_empty());
    compare("sources", &sourced, &false, true);
    let covered = h.subjects.iter().any(|s| w.subjects.contains(s));
    let subjects = if covered { &w.subjects } else { &h.subjects };
    compare("subjects", subjects, &w.subjects, false);
    compare(
        "duplicate_window",
        &h.duplicate_window,
        &w.duplicate_window,
        false,
    );
    compare("num_replicas", &h.num_replicas, &w.num_replicas, false);
    // No limit: every event is kept until it is deleted by hand.
    for (setting, limit) in [
        ("max_age (ns)", h.max_age.as_nanos() as i64),
        ("max_msgs", h.max_messages),
        ("max_bytes", h.max_bytes),
        ("max_msgs_per_subject", h.max_messages_per_subject),
        ("max_msg_size", i64::from(h.max_message_size)),
    ] {
        let limit = (limit > 0).then_some(limit);
        compare(setting, &limit, &None::<i64>, false);
    }
    changes
}

/// The existing settings with the wanted ones put in ([`stream_changes`]
/// names them): the subjects added,
/// the window and replicas replaced, the limits lifted; the rest (what an
/// operator tuned that the configuration does not decide) kept.
fn updated(mut has: stream::Config, wants: &stream::Config) -> stream::Config {
    for subject in &wants.subjects {
        if !has.subjects.contains(subject) {
            has.subjects.push(subject.clone());
        }
    }
    has.duplicate_window = wants.duplicate_window;
    has.num_replicas = wants.num_replicas;
    has.max_age = Duration::ZERO;
    (
        has.max_messages,
        has.max_bytes,
        has.max_messages_per_subject,
    ) = (-1, -1, -1);
    has
}

/// The subject of one event: `<prefix>.<merchant id>.<event type>`, so a
/// consumer can take one merchant's events, or one type's of every merchant.
pub fn subject(config: &Broker, merchant_id: uuid::Uuid, event_type: &str) -> String {
    format!("{}.{merchant_id}.{event_type}", config.subject_prefix)
}
