//! Typed errors and completion statuses.

use std::io;

/// Status of a work completion; mirrors `ibv_wc_status` (the numeric values match).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum WcStatus {
    /// The operation completed.
    Success = 0,
    /// Local length error: a received message did not fit the posted receive buffer.
    LocalLength = 1,
    /// Local QP operation error (internal consistency failure at the requester).
    LocalQpOperation = 2,
    /// Local protection error: an SGE names memory outside its region, a region of
    /// another protection domain, or without the access the operation needs.
    LocalProtection = 4,
    /// Work request flushed because the QP is in the error state.
    WrFlush = 5,
    /// The responder could not execute the request (bad length, opcode, or its
    /// receive buffer was too small).
    RemoteInvalidRequest = 9,
    /// The responder rejected the rkey, the bounds or the access flags.
    RemoteAccess = 10,
    /// The responder failed while executing the request.
    RemoteOperation = 11,
    /// The transport to the peer failed (peer vanished) before the request was acknowledged.
    RetryExceeded = 12,
    /// The responder had no receive posted for longer than the QP's RNR timeout.
    RnrRetryExceeded = 13,
}

impl WcStatus {
    /// Decodes the wire byte.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Success,
            1 => Self::LocalLength,
            2 => Self::LocalQpOperation,
            4 => Self::LocalProtection,
            5 => Self::WrFlush,
            9 => Self::RemoteInvalidRequest,
            10 => Self::RemoteAccess,
            11 => Self::RemoteOperation,
            12 => Self::RetryExceeded,
            13 => Self::RnrRetryExceeded,
            _ => return None,
        })
    }

    /// True for [`WcStatus::Success`].
    pub fn is_ok(self) -> bool {
        self == Self::Success
    }
}

impl std::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Self::Success => "success",
            Self::LocalLength => "local length error",
            Self::LocalQpOperation => "local QP operation error",
            Self::LocalProtection => "local protection error",
            Self::WrFlush => "work request flushed",
            Self::RemoteInvalidRequest => "remote invalid request",
            Self::RemoteAccess => "remote access error",
            Self::RemoteOperation => "remote operation error",
            Self::RetryExceeded => "transport retry counter exceeded",
            Self::RnrRetryExceeded => "RNR retry counter exceeded",
        };
        f.write_str(s)
    }
}

/// Errors returned by fabric calls (as opposed to completions, which carry a [`WcStatus`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// A caller passed an argument the API cannot accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// Registered memory could not be allocated.
    #[error("cannot allocate {bytes} bytes of registrable memory")]
    Alloc {
        /// How many bytes were asked for.
        bytes: u64,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// The send or receive queue is full; poll the CQ and retry (backpressure).
    #[error("{queue} queue full ({depth} work requests outstanding)")]
    QueueFull {
        /// "send" or "receive".
        queue: &'static str,
        /// The queue's depth.
        depth: u32,
    },
    /// The completion queue overflowed: completions were lost, as on hardware.
    #[error("completion queue overrun (depth {depth})")]
    CqOverrun {
        /// The CQ's depth.
        depth: u32,
    },
    /// Setting up the progress engine (io_uring) failed.
    #[error("cannot start the fabric's progress engine")]
    Engine(#[source] io::Error),
    /// Binding a listener failed.
    #[error("cannot listen on {addr}")]
    Listen {
        /// The address.
        addr: std::net::SocketAddr,
        /// What the OS said.
        #[source]
        source: io::Error,
    },
    /// Connecting to or accepting a peer failed.
    #[error("connection setup with {peer} failed during {stage}")]
    Connect {
        /// The peer address.
        peer: String,
        /// Which stage: "tcp connect", "handshake", ...
        stage: &'static str,
        /// What went wrong.
        #[source]
        source: io::Error,
    },
    /// The peer did not prove knowledge of the job secret (or we failed to prove ours).
    #[error("authentication with {peer} failed: {reason}")]
    AuthFailed {
        /// The peer address.
        peer: String,
        /// Which side's proof failed.
        reason: &'static str,
    },
    /// The peer speaks something else (bad magic or version).
    #[error("peer {peer} speaks an incompatible protocol: {reason}")]
    Protocol {
        /// The peer address.
        peer: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// No connection arrived in time.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
}

/// Shorthand for fabric results.
pub type Result<T, E = FabricError> = std::result::Result<T, E>;
