//! # eps
//!
//! The public Rust facade of EPS, the elastic parameter server, and the library
//! behind the `eps` command line.
//!
//! - [`fabric`]: the verbs-semantics transport (re-export of `eps-fabric`).
//! - [`units`]: parsing of human sizes (`4KiB`, `64MiB`).
//! - [`bench`]: the `eps bench ...` measurements.

pub use eps_fabric as fabric;

pub mod bench;
pub mod units;
