//! Completion queues of the soft provider.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::api::{Completion, CompletionQueue};
use crate::error::{FabricError, Result};

use super::qp::Requester;

/// What a sleeping poller should wait for on one requester.
pub(crate) enum WaitOn {
    /// Nothing of its own (its wake-ups come through the CQ's eventfd).
    Nothing,
    /// This descriptor, for these `poll(2)` events.
    Fd(RawFd, i16),
    /// Work is ready now: do not sleep.
    Ready,
}

/// The requester half of a QP as its send CQ drives it: from the poller's
/// thread (`progress`), and around a sleep (`wait_on`, then `waited`). Every
/// provider that reaps on the caller's thread implements it (`soft`, `shm`).
pub(crate) trait Drive: Send + Sync + std::fmt::Debug {
    /// Transmits and reaps what it can without blocking.
    fn progress(&self);
    /// Prepares to sleep; says what to wait for.
    fn wait_on(&self) -> WaitOn;
    /// The sleep is over.
    fn waited(&self) {}
}

impl Drive for Mutex<Requester> {
    fn progress(&self) {
        // Another thread driving this QP right now is as good as us doing it.
        if let Ok(mut r) = self.try_lock() {
            r.progress();
        }
    }

    fn wait_on(&self) -> WaitOn {
        match self.try_lock().ok().and_then(|r| r.wait_interest()) {
            Some((fd, events)) => WaitOn::Fd(fd, events),
            None => WaitOn::Nothing,
        }
    }
}

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
    pub(crate) requesters: Mutex<Vec<Arc<dyn Drive>>>,
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

    /// Stops driving `r` (its QP is being destroyed).
    pub(crate) fn detach<D: Drive + 'static>(&self, r: &Arc<D>) {
        let mut list = self.requesters.lock().unwrap_or_else(|p| p.into_inner());
        list.retain(|x| !std::ptr::addr_eq(Arc::as_ptr(x), Arc::as_ptr(r)));
    }

    /// Starts driving `r` from this CQ's polls.
    pub(crate) fn attach(&self, r: Arc<dyn Drive>) {
        self.requesters.lock().unwrap_or_else(|p| p.into_inner()).push(r);
    }

    /// The eventfd a sleeping poller waits on (a peer on the same host is handed a
    /// copy to wake it).
    pub(crate) fn notify_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.notify.as_fd()
    }

    /// Wakes a sleeping poller.
    pub(crate) fn wake(&self) {
        super::sys::eventfd_signal(&self.notify);
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
            let mut busy = false;
            let list = self.inner.requesters.lock().unwrap_or_else(|p| p.into_inner()).clone();
            for r in &list {
                match r.wait_on() {
                    WaitOn::Nothing => {}
                    WaitOn::Ready => busy = true,
                    // Too many sockets to watch: nap briefly instead of missing one.
                    WaitOn::Fd(..) if n == WAIT_FDS => busy = true,
                    WaitOn::Fd(fd, events) => {
                        fds[n] = libc::pollfd { fd, events, revents: 0 };
                        n += 1;
                    }
                }
            }
            let ms = if busy { 0 } else { timeout.as_millis().clamp(1, i32::MAX as u128) as i32 };
            super::sys::poll_fds(&mut fds[..n], ms);
            if fds[0].revents != 0 {
                super::sys::eventfd_drain(&self.inner.notify);
            }
            for r in &list {
                r.waited();
            }
        }
        self.inner.waiters.fetch_sub(1, Ordering::AcqRel);
    }

    fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        {
            let list = self.inner.requesters.lock().unwrap_or_else(|p| p.into_inner());
            for r in list.iter() {
                r.progress();
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
