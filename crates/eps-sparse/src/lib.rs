//! # eps-sparse
//!
//! Sparse embedding tables, free of I/O: rows addressed by u64 keys, created on
//! first touch from an initializer that depends on the key alone (so a row is
//! the same whichever server creates it), stepped by row-wise optimizers with
//! lazy state (a row's Adam step count is its own), evicted when idle or
//! rarely touched. Keys fall into key-hash buckets ([`bucket`]), the unit of
//! placement and migration as dense shards are.

#![forbid(unsafe_code)]

pub mod batch;
pub mod bucket;
pub mod decl;
pub mod index;
pub mod init;
pub mod moves;
pub mod optim;
mod pages;
pub mod part;
pub mod saves;
pub mod table;
pub mod wire;
pub mod zipf;

pub use init::Init;
pub use optim::RowOptimizer;
pub use table::{RowTable, TableSpec};

/// What a sparse table refuses.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SparseError {
    /// A row dimension of 0, or too large.
    #[error("row dimension {0}: it must be 1 to {max}", max = table::MAX_DIM)]
    Dim(usize),
    /// A buffer whose length does not match its keys.
    #[error("{what}: {got} values for {keys} keys of dimension {dim} (want {want})")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// How many keys.
        keys: usize,
        /// The row dimension.
        dim: usize,
        /// The length it must have.
        want: usize,
    },
    /// A key pushed twice in one push (duplicates are summed first: see
    /// [`table::sum_duplicates`]).
    #[error("key {0} appears twice in one push: sum duplicates first")]
    Duplicate(u64),
    /// Rows moved between servers that do not parse or do not fit.
    #[error("moved rows: {0}")]
    Rows(String),
    /// A bucket map without one owner per bucket.
    #[error("a bucket map of {0} entries (one per bucket: {buckets})", buckets = bucket::BUCKETS)]
    Buckets(usize),
}
