//! The workshop's HTTP routes, under `/demo/` (mounted only with
//! `DEMO_UNSAFE_ENDPOINTS=true`, but for the recording of traced requests):
//! the naive and guarded endpoints the blocks and the lab compare, the
//! webhook receivers, and the lab's timelines. They use the API's
//! extractors and problems (`crate::http`); nothing of the API uses them.

pub mod demo;
pub mod receiver;
