//! Nothing to build: the crate's build-dependencies are there only for their
//! features (see Cargo.toml).
fn main() {}
