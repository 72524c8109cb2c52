//! The properties' names: what the checker holds every state to, one rule
//! each ([`crate::model`] states them; [`crate::variant`] names the one each
//! naive design breaks).

pub const ONE_PAYMENT: &str = "at most one payment per logical operation";
pub const SAME_ANSWER: &str = "a replay's answer is the first answer";
pub const NOT_LOST: &str = "no acknowledged charge is lost";
pub const REUSE: &str = "a key reused with other parameters never gets the first answer";
pub const AGREE: &str = "no money moves for a charge recorded as failed";
pub const LEAVES_PROCESSING: &str = "every key eventually leaves processing";
pub const SUCCEEDS: &str = "a charge succeeds";
pub const CRASHES: &str = "a crash happens";
pub const REPLAYS: &str = "a replay occurs";
