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

use crate::broker::settings::Changes;
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

/// Each setting of `held` that differs from `wanted`.
pub fn changes(held: &consumer::Config, wanted: &pull::Config) -> Changes {
    let (h, w) = (held, wanted);
    let mut changes = Changes::default();
    let mut compare = |setting, held: &dyn fmt::Debug, wanted: &dyn fmt::Debug, fixed| {
        changes.compare(setting, format!("{held:?}"), format!("{wanted:?}"), fixed);
    };
    compare("ack_policy", &h.ack_policy, &w.ack_policy, true);
    compare("deliver_policy", &h.deliver_policy, &w.deliver_policy, true);
    compare("replay_policy", &h.replay_policy, &w.replay_policy, true);
    compare("headers_only", &h.headers_only, &w.headers_only, true);
    compare("ack_wait", &h.ack_wait, &w.ack_wait, false);
    compare("max_deliver", &h.max_deliver, &w.max_deliver, false);
    compare(
        "filter_subject",
        &h.filter_subject,
        &w.filter_subject,
        false,
    );
    compare("backoff", &h.backoff, &w.backoff, false);
    changes
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
