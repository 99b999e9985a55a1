//! Process-wide figures of the transport, whatever the provider, for the
//! metrics: bytes of memory registered (live regions), and completions that
//! ended in error, by status. Each is one relaxed atomic add. And the
//! providers' warnings, into the process's log.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::api::Completion;
use crate::error::WcStatus;

static REGISTERED: AtomicI64 = AtomicI64::new(0);

/// By `WcStatus as usize` (statuses are below 16).
static ERRORS: [AtomicU64; 16] = [const { AtomicU64::new(0) }; 16];

/// Every error status, in order, with its label for the metrics.
pub const ERROR_KINDS: [(WcStatus, &str); 9] = [
    (WcStatus::LocalLength, "local_length"),
    (WcStatus::LocalQpOperation, "local_qp_operation"),
    (WcStatus::LocalProtection, "local_protection"),
    (WcStatus::WrFlush, "flushed"),
    (WcStatus::RemoteInvalidRequest, "remote_invalid_request"),
    (WcStatus::RemoteAccess, "remote_access"),
    (WcStatus::RemoteOperation, "remote_operation"),
    (WcStatus::RetryExceeded, "retry_exceeded"),
    (WcStatus::RnrRetryExceeded, "rnr_retry_exceeded"),
];

/// A provider registered (`bytes > 0`) or deregistered (`< 0`) memory.
pub fn registered(bytes: i64) {
    REGISTERED.fetch_add(bytes, Ordering::Relaxed);
}

/// Bytes of memory in live registered regions of this process.
pub fn registered_bytes() -> u64 {
    REGISTERED.load(Ordering::Relaxed).max(0) as u64
}

/// Counts the errors among completions a provider hands out.
pub fn completions(cs: &[Completion]) {
    for c in cs {
        if c.status != WcStatus::Success {
            ERRORS[c.status as usize % ERRORS.len()].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A provider's warning: a `tracing` event where the process installed a
/// log subscriber (the `eps` binary always does), else a line on stderr.
pub fn warn(line: &str) {
    if tracing::dispatcher::has_been_set() {
        tracing::warn!(target: "eps", "{line}");
    } else {
        use std::io::Write;
        let _ = std::io::stderr().lock().write_all(format!("{line}\n").as_bytes());
    }
}

/// Completions of this process that ended with `status`.
pub fn errors(status: WcStatus) -> u64 {
    ERRORS[status as usize % ERRORS.len()].load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use crate::prelude::*;

    /// A region counts while it lives (other tests' regions only add to the figure).
    #[test]
    fn registered_memory_counts_live_regions() {
        let dev = SoftDevice::open().unwrap();
        let pd = dev.alloc_pd();
        let big = 64 << 20;
        let mr = pd.alloc_mr(big, Access::LOCAL_WRITE).unwrap();
        assert!(super::registered_bytes() >= big as u64);
        drop(mr);
        assert!(super::registered_bytes() < big as u64, "{}", super::registered_bytes());
    }
}
