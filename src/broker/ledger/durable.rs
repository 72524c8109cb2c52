//! The ledger's durable consumer against the configuration. JetStream keeps
//! a durable consumer's settings as it was made, whatever the process that
//! reads it now was told; at every start the ledger compares them with what
//! the configuration asks. Where they differ and JetStream lets an update
//! change the setting (`ack_wait`, `max_deliver`, `filter_subject`,
//! `backoff`), the configuration wins; where it does not (`ack_policy`,
//! `deliver_policy`, `replay_policy`), the ledger refuses to start and names
//! each one, rather than run on settings nobody chose.

use std::fmt;

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, FromConsumer, pull};

use crate::config::Broker;

/// The settings the durable consumer `name` must have: every message of the
/// stream from its start, each acknowledged explicitly, delivered again
/// `CONSUMER_ACK_WAIT` after a delivery nobody acknowledged. JetStream
/// delivers a message as often as it takes (`max_deliver` -1): its own bound
/// would stop delivering silently, so the ledger parks a failing message
/// itself after `CONSUMER_MAX_DELIVER` deliveries instead (see `docs/broker.md`).
pub fn wanted(config: &Broker, name: &str) -> pull::Config {
    pull::Config {
        durable_name: Some(name.to_owned()),
        deliver_policy: DeliverPolicy::All,
        ack_policy: AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_deliver: -1,
        ..Default::default()
    }
}

/// A setting of the durable consumer that is not the configuration's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    pub setting: &'static str,
    pub held: String,
    pub wanted: String,
    /// Whether JetStream lets an update change it.
    pub updatable: bool,
}

/// Each setting of `held` that differs from `wanted`.
pub fn differences(held: &consumer::Config, wanted: &pull::Config) -> Vec<Difference> {
    let debug = |value: &dyn fmt::Debug| format!("{value:?}");
    let fixed = [
        (
            "ack_policy",
            debug(&held.ack_policy),
            debug(&wanted.ack_policy),
        ),
        (
            "deliver_policy",
            debug(&held.deliver_policy),
            debug(&wanted.deliver_policy),
        ),
        (
            "replay_policy",
            debug(&held.replay_policy),
            debug(&wanted.replay_policy),
        ),
    ];
    let updatable = [
        ("ack_wait", debug(&held.ack_wait), debug(&wanted.ack_wait)),
        (
            "max_deliver",
            debug(&held.max_deliver),
            debug(&wanted.max_deliver),
        ),
        (
            "filter_subject",
            debug(&held.filter_subject),
            debug(&wanted.filter_subject),
        ),
        ("backoff", debug(&held.backoff), debug(&wanted.backoff)),
    ];
    let fixed = fixed.into_iter().map(|setting| (setting, false));
    let updatable = updatable.into_iter().map(|setting| (setting, true));
    fixed
        .chain(updatable)
        .filter(|((_, held, wanted), _)| held != wanted)
        .map(|((setting, held, wanted), updatable)| Difference {
            setting,
            held,
            wanted,
            updatable,
        })
        .collect()
}

/// `held` with its updatable settings set to `wanted`'s; the rest (what an
/// operator tuned that the configuration does not decide) kept.
pub fn updated(held: &consumer::Config, wanted: &pull::Config) -> anyhow::Result<pull::Config> {
    let mut config = held.clone();
    config.ack_wait = wanted.ack_wait;
    config.max_deliver = wanted.max_deliver;
    config.filter_subject = wanted.filter_subject.clone();
    config.backoff = wanted.backoff.clone();
    pull::Config::try_from_consumer_config(config)
        .map_err(|e| anyhow::anyhow!("the durable consumer's settings: {e}"))
}

/// The durable consumer holds settings JetStream cannot change, and the
/// configuration asks for others: the ledger does not start.
#[derive(Debug, thiserror::Error)]
pub struct Refused {
    pub consumer: String,
    pub stream: String,
    pub differences: Vec<Difference>,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the durable consumer {} of the stream {} has settings JetStream cannot change:",
            self.consumer, self.stream
        )?;
        for d in &self.differences {
            write!(
                f,
                " {} is {}, the configuration asks {};",
                d.setting, d.held, d.wanted
            )?;
        }
        write!(
            f,
            " delete it (nats consumer rm {} {}) and it is made again: a new one reads the stream \
             from its start, and the inbox skips every event already applied",
            self.stream, self.consumer
        )
    }
}

/// Says in a line what a difference is, for the log of an update.
pub fn describe(differences: &[Difference]) -> String {
    differences
        .iter()
        .map(|d| format!("{} {} -> {}", d.setting, d.held, d.wanted))
        .collect::<Vec<_>>()
        .join(", ")
}
