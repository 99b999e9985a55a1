//! # eps-control
//!
//! The thin control plane of EPS: it owns the job spec, membership and placement,
//! and is never on the data path. Metadata lives behind the [`store::Store`] trait; the
//! default [`store::FileStore`] is an fsync'd append-only log, so one `eps` command
//! runs a whole local cluster without external services. Every connection proves the
//! job secret (HMAC-SHA256 challenge-response) before any request is served.

#![forbid(unsafe_code)]

pub mod job;
pub mod server;
pub mod standby;
pub mod store;

pub use eps_control_client::{
    CHANGE_IN_PROGRESS, ControlAddrs, ControlClient, ControlError, NOT_LEADER, STILL_STARTING, VOTE_IN_PROGRESS, checkpoint,
    client,
};
pub use server::ControlService;

use eps_control_client::conn;
