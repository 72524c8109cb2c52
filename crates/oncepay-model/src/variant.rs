//! The protocol and the naive designs it is compared with: one switch of
//! the same model each.

use std::fmt;

use crate::properties::{AGREE, ONE_PAYMENT, REUSE};

/// The protocol, or one of the naive designs it is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// oncepay's protocol.
    Real,
    /// The key is read, then written: two requests both find it free.
    CheckThenAct,
    /// No claim: the key and its answer are written after the work.
    KeyAfterWork,
    /// The key is claimed alone; the charge is written after the gateway's
    /// call, in a second transaction, so a crash leaves a key with nothing
    /// to recover.
    TwoTransactions,
    /// Keys expire while the client may still retry.
    ShortTtl,
    /// The client makes a new key for each attempt.
    NewKeyPerAttempt,
    /// The request's parameters are not compared with the key's first.
    NoFingerprint,
    /// The sweeper settles a stale charge as failed without asking the
    /// gateway: no void fences off the authorization still on its way.
    NoVoidFence,
    /// The key in Redis (`SET NX`), the charge in Postgres, the answer
    /// written back to Redis after the work.
    RedisSetNx,
}

impl Variant {
    /// Every variant, the protocol first.
    pub const ALL: [Variant; 9] = [
        Variant::Real,
        Variant::CheckThenAct,
        Variant::KeyAfterWork,
        Variant::TwoTransactions,
        Variant::ShortTtl,
        Variant::NewKeyPerAttempt,
        Variant::NoFingerprint,
        Variant::NoVoidFence,
        Variant::RedisSetNx,
    ];

    /// Its name on the command line: `check-then-act`.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Real => "real",
            Variant::CheckThenAct => "check-then-act",
            Variant::KeyAfterWork => "key-after-work",
            Variant::TwoTransactions => "two-transactions",
            Variant::ShortTtl => "short-ttl",
            Variant::NewKeyPerAttempt => "new-key-per-attempt",
            Variant::NoFingerprint => "no-fingerprint",
            Variant::NoVoidFence => "no-void-fence",
            Variant::RedisSetNx => "redis-set-nx",
        }
    }

    pub fn parse(name: &str) -> Option<Variant> {
        Variant::ALL.into_iter().find(|v| v.name() == name)
    }

    /// The property this variant is expected to break; `None` for the
    /// protocol, which breaks none.
    pub fn breaks(self) -> Option<&'static str> {
        Some(match self {
            Variant::Real => return None,
            Variant::NoFingerprint => REUSE,
            Variant::NoVoidFence => AGREE,
            _ => ONE_PAYMENT,
        })
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
