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
pub mod watch;

use anyhow::Context as _;
use std::time::Duration;

use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind};
use async_nats::jetstream::{self, ErrorCode, stream};

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
    let changes = Changes::of(&has, &wanted);
    if changes.is_empty() {
        return Ok(existing);
    }
    changes.refuse_fixed(&format!("the stream {}", config.stream))?;
    tracing::warn!(stream = %config.stream, changes = %changes, "the stream's settings differ from the configuration: updating them");
    js.update_stream(changes.apply(has, &wanted))
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

/// The settings of an existing stream that differ from the configuration.
struct Changes(Vec<Change>);

/// One setting that differs: what the stream has, what the configuration
/// wants, and whether JetStream can change it on an existing stream.
struct Change {
    setting: &'static str,
    has: String,
    wants: String,
    fixed: bool,
}

impl Changes {
    /// Each setting the relay relies on, compared.
    fn of(has: &stream::Config, wants: &stream::Config) -> Self {
        let mut changes = Vec::new();
        let mut differ = |setting, has: String, wants: String, fixed| {
            if has != wants {
                changes.push(Change {
                    setting,
                    has,
                    wants,
                    fixed,
                });
            }
        };
        differ(
            "storage",
            format!("{:?}", has.storage),
            format!("{:?}", wants.storage),
            true,
        );
        differ(
            "retention",
            format!("{:?}", has.retention),
            format!("{:?}", wants.retention),
            true,
        );
        let covered = has.subjects.iter().any(|s| wants.subjects.contains(s));
        let subjects = if covered {
            &wants.subjects
        } else {
            &has.subjects
        };
        differ(
            "subjects",
            subjects.join(","),
            wants.subjects.join(","),
            false,
        );
        differ(
            "duplicate_window",
            format!("{:?}", has.duplicate_window),
            format!("{:?}", wants.duplicate_window),
            false,
        );
        differ(
            "num_replicas",
            has.num_replicas.to_string(),
            wants.num_replicas.to_string(),
            false,
        );
        // No limit: every event is kept until it is deleted by hand.
        let age = has.max_age.as_nanos() as i64;
        for (setting, limit) in [
            ("max_age (ns)", age),
            ("max_msgs", has.max_messages),
            ("max_bytes", has.max_bytes),
            ("max_msgs_per_subject", has.max_messages_per_subject),
        ] {
            let has = if limit > 0 {
                limit.to_string()
            } else {
                "none".into()
            };
            differ(setting, has, "none".into(), false);
        }
        Changes(changes)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// An error naming each setting JetStream cannot change, if any.
    fn refuse_fixed(&self, what: &str) -> anyhow::Result<()> {
        let fixed: Vec<String> = (self.0.iter().filter(|c| c.fixed))
            .map(|c| {
                format!(
                    "{} is {} but the configuration wants {}",
                    c.setting, c.has, c.wants
                )
            })
            .collect();
        anyhow::ensure!(
            fixed.is_empty(),
            "{what} was made with settings JetStream cannot change: {}; set NATS_STREAM to \
             another stream, or delete this one, then rewind the relay (docs/broker.md)",
            fixed.join("; ")
        );
        Ok(())
    }

    /// The existing settings with the configuration's put in: the subjects
    /// added, the rest replaced.
    fn apply(&self, mut has: stream::Config, wants: &stream::Config) -> stream::Config {
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
}

impl std::fmt::Display for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let each: Vec<String> = (self.0.iter())
            .map(|c| format!("{}: {} -> {}", c.setting, c.has, c.wants))
            .collect();
        f.write_str(&each.join(", "))
    }
}

/// The subject of one event: `<prefix>.<merchant id>.<event type>`, so a
/// consumer can take one merchant's events, or one type's of every merchant.
pub fn subject(config: &Broker, merchant_id: uuid::Uuid, event_type: &str) -> String {
    format!("{}.{merchant_id}.{event_type}", config.subject_prefix)
}
