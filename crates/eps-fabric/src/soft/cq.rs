//! Completion queues of the soft provider.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::{Completion, CompletionQueue};
use crate::error::{FabricError, Result};

use super::qp::Requester;

/// Most file descriptors one `wait` watches.
const WAIT_FDS: usize = 64;

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
    /// Threads sleeping in `wait`, woken by `push` through `notify`.
    waiters: AtomicUsize,
    /// eventfd signalled by `push` while someone waits.
    notify: OwnedFd,
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
            super::sys::eventfd_signal(&self.notify);
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
                notify: super::sys::eventfd().map_err(FabricError::Engine)?,
                requesters: Mutex::new(Vec::new()),
            }),
        })
    }
}

impl CompletionQueue for SoftCq {
    fn wait(&self, timeout: Duration) {
        // Sleep in poll(2) on the CQ's eventfd (completions the progress thread
        // delivers) and on the requester sockets of QPs with requests outstanding
        // (their responses, or room to transmit what is still queued).
        self.inner.waiters.fetch_add(1, Ordering::AcqRel);
        let empty = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner()).is_empty();
        if empty {
            let mut fds = [libc::pollfd { fd: self.inner.notify.as_raw_fd(), events: libc::POLLIN, revents: 0 }; WAIT_FDS];
            let mut n = 1;
            let mut crowded = false;
            for r in self.inner.requesters.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                let Ok(r) = r.try_lock() else { continue };
                if let Some((fd, events)) = r.wait_interest() {
                    if n == WAIT_FDS {
                        crowded = true;
                        break;
                    }
                    fds[n] = libc::pollfd { fd, events, revents: 0 };
                    n += 1;
                }
            }
            // Too many sockets to watch: nap briefly instead of missing one.
            let ms = if crowded { 0 } else { timeout.as_millis().clamp(1, i32::MAX as u128) as i32 };
            super::sys::poll_fds(&mut fds[..n], ms);
            if fds[0].revents != 0 {
                super::sys::eventfd_drain(&self.inner.notify);
            }
        }
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
        crate::stats::completions(&out[..n]);
        Ok(n)
    }
}
