//! Completion queues of the soft provider.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::api::{Completion, CompletionQueue};
use crate::error::{FabricError, Result};

use super::qp::Requester;

/// A completion queue. Polling it also drives the requester side (transmit and
/// response reaping) of every QP whose send queue reports here.
#[derive(Debug, Clone)]
pub struct SoftCq {
    pub(crate) inner: Arc<CqInner>,
}

#[derive(Debug)]
pub(crate) struct CqInner {
    queue: Mutex<VecDeque<Completion>>,
    depth: u32,
    overrun: AtomicBool,
    /// Threads sleeping in `wait`, woken by `push`.
    waiters: AtomicUsize,
    ready: Condvar,
    /// Requesters whose send completions land here.
    pub(crate) requesters: Mutex<Vec<Arc<Mutex<Requester>>>>,
}

impl CqInner {
    /// Appends a completion; past `depth` the CQ is overrun (completions are lost, as on
    /// hardware) and the next poll reports it.
    pub(crate) fn push(&self, c: Completion) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= self.depth as usize {
            self.overrun.store(true, Ordering::Release);
            return;
        }
        q.push_back(c);
        drop(q);
        if self.waiters.load(Ordering::Acquire) > 0 {
            self.ready.notify_all();
        }
    }

    pub(crate) fn detach(&self, r: &Arc<Mutex<Requester>>) {
        let mut list = self.requesters.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|x| !Arc::ptr_eq(x, r));
    }
}

impl SoftCq {
    pub(crate) fn new(depth: u32) -> Result<Self> {
        if depth == 0 {
            return Err(FabricError::InvalidArgument("CQ depth must be at least 1"));
        }
        Ok(Self {
            inner: Arc::new(CqInner {
                queue: Mutex::new(VecDeque::with_capacity(depth as usize)),
                depth,
                overrun: AtomicBool::new(false),
                waiters: AtomicUsize::new(0),
                ready: Condvar::new(),
                requesters: Mutex::new(Vec::new()),
            }),
        })
    }
}

impl CompletionQueue for SoftCq {
    fn wait(&self, timeout: Duration) {
        let q = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner());
        if !q.is_empty() {
            return;
        }
        self.inner.waiters.fetch_add(1, Ordering::AcqRel);
        let _ = self.inner.ready.wait_timeout(q, timeout);
        self.inner.waiters.fetch_sub(1, Ordering::AcqRel);
    }

    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        {
            let list = self.inner.requesters.lock().unwrap_or_else(|p| p.into_inner());
            for r in list.iter() {
                // Another thread driving this QP right now is as good as us doing it.
                if let Ok(mut r) = r.try_lock() {
                    r.progress();
                }
            }
        }
        if self.inner.overrun.swap(false, Ordering::AcqRel) {
            return Err(FabricError::CqOverrun { depth: self.inner.depth });
        }
        let mut q = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner());
        let n = out.len().min(q.len());
        for (slot, c) in out.iter_mut().zip(q.drain(..n)) {
            *slot = c;
        }
        Ok(n)
    }
}
