//! The server's speed mechanisms, each at an edge of the core, never inside
//! its claim loop, and none deciding an outcome:
//!
//! - [`front`]: in front of the core. A completed key is answered before the
//!   core is entered, from the replay cache ([`cache`]) or, while retries are
//!   common, from a read of the key coalesced with other requests' reads
//!   ([`reads`]). Anything else goes to the core, whose claim decides.
//! - [`admission`]: the core's one seam for taking a connection
//!   (`oncepay_core::speed::Admission`): a bounded queue that sheds a request
//!   before it has begun anything.
//! - [`wait`]: the core's one seam for waiting on a key in flight
//!   (`oncepay_core::speed::Waits`): one shared poll per key, woken when the
//!   key's holder here finishes.
//! - [`timing`]: the clock each request's phases are timed on.

pub mod admission;
pub mod cache;
pub mod front;
pub mod reads;
pub mod timing;
pub mod wait;
