//! # eps-control-client
//!
//! What a member of a job (server, worker, `libeps`, the CLI) needs to talk to
//! the control plane, and nothing of the service: the framed, authenticated
//! connection ([`conn`]), the client that retries across standbys
//! ([`ControlClient`]), the errors both sides share, and the checkpoint file
//! pieces servers write and read ([`checkpoint`]). Linking it does not link
//! the control service, its stores, or etcd.

#![forbid(unsafe_code)]

pub mod checkpoint;
pub mod client;
pub mod conn;

pub use client::{ControlAddrs, ControlClient};

/// Errors of the control plane and its clients.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Socket I/O failed.
    #[error("control connection I/O")]
    Io(#[source] std::io::Error),
    /// Could not bind the listen address.
    #[error("cannot listen on {addr}")]
    Bind {
        /// Address.
        addr: std::net::SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Could not reach the control plane.
    #[error("cannot reach the control plane at {addr}")]
    Connect {
        /// Address.
        addr: std::net::SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The store failed.
    #[error("control store")]
    Store(#[source] std::io::Error),
    /// Authentication failed.
    #[error("control authentication failed: {0}")]
    Auth(&'static str),
    /// The peer at an address did not prove the job secret (a wrong address,
    /// or another job's secret).
    #[error(
        "the peer at {addr} is not this job's control plane: {why} (check the control address, EPS_CONTROL, and that the job secret is the job's)"
    )]
    NotOurs {
        /// Address tried.
        addr: std::net::SocketAddr,
        /// What failed.
        why: &'static str,
    },
    /// Malformed traffic or state.
    #[error("control protocol: {0}")]
    Protocol(&'static str),
    /// No answer in time (for a plan: some servers never became ready).
    #[error("the control plane did not answer in time (are all servers and workers of the job started?)")]
    Timeout,
    /// The control plane refused the request: decide by its code.
    #[error("control plane refused: {0}")]
    Rejected(eps_proto::control::Refusal),
}

/// The refusal of a request that needs the job's initial servers.
pub const STILL_STARTING: &str = "the job is still starting: its initial servers are not all ready";
/// How a standby control plane's answer to every request begins (the
/// client asks the next address).
pub const NOT_LEADER: &str = "not the leader";
/// How the refusal of a change begins while another is under way.
pub const CHANGE_IN_PROGRESS: &str = "a scale event is in progress";
/// How the refusal of a change begins while a worker change is voted on.
pub const VOTE_IN_PROGRESS: &str = "a worker membership change is being voted on";

impl ControlError {
    /// A refusal that the same request may not get later: the job still
    /// starting, or another change still under way.
    pub fn is_temporary(&self) -> bool {
        matches!(self, Self::Rejected(r) if r.code.is_temporary())
    }

    /// The refusal's code, when the control plane refused.
    pub fn code(&self) -> Option<eps_proto::control::ErrorCode> {
        match self {
            Self::Rejected(r) => Some(r.code),
            _ => None,
        }
    }
}
