//! The worker's background thread: it long-polls the control plane for newer
//! maps (so no iteration waits on it), reports the epoch the worker routes with
//! (servers scaled away leave once nobody routes to them), renews the worker's
//! lease with every poll, and votes on membership changes.
//!
//! A vote names the first iteration this worker has not begun; from the vote on,
//! [`MapWatch::begin`] holds there until the change is committed, so no worker
//! computes an iteration whose contributor set is still open. The vote is sent
//! from this thread, so it is answered even while the training thread waits for
//! pulls.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use eps_control_client::ControlClient;
use eps_proto::control::{ControlMsg, JobMap, Role};
use eps_proto::membership::Membership;

use crate::{WorkerConfig, WorkerError};

/// What the training thread and the watcher share about membership.
#[derive(Debug)]
pub(crate) struct Members {
    pub(crate) membership: Membership,
    /// The first iteration the training thread has not begun.
    pub(crate) next: u64,
    /// A vote is open: do not begin this iteration or later.
    hold: Option<u64>,
    /// The last proposal voted on.
    voted: u64,
}

/// The newest map and membership, shared with the watcher thread.
pub(crate) struct MapWatch {
    pub(crate) latest: Mutex<Option<JobMap>>,
    pub(crate) newest: AtomicU64,
    pub(crate) adopted: AtomicU64,
    pub(crate) stop: Arc<AtomicBool>,
    members: Mutex<Members>,
    changed: Condvar,
}

impl MapWatch {
    pub(crate) fn new(map: &JobMap, membership: Membership, next: u64) -> Self {
        Self {
            latest: Mutex::new(None),
            newest: AtomicU64::new(map.epoch),
            adopted: AtomicU64::new(map.epoch),
            stop: Arc::new(AtomicBool::new(false)),
            members: Mutex::new(Members { membership, next, hold: None, voted: 0 }),
            changed: Condvar::new(),
        }
    }

    /// Begins iteration `t`: waits while a membership vote holds it, then returns
    /// the membership to compute it with.
    pub(crate) fn begin(&self, t: u64, timeout: Duration) -> Result<Membership, WorkerError> {
        let deadline = Instant::now() + timeout;
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        while m.hold.is_some_and(|h| t >= h) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(WorkerError::Timeout("a worker membership change to be committed"));
            }
            m = self.changed.wait_timeout(m, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        m.next = m.next.max(t + 1);
        Ok(m.membership.clone())
    }

    /// Takes in a map's membership and proposal; returns the vote to send, if any.
    fn observe(&self, map: &JobMap) -> Option<(u64, u64)> {
        let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ms) = Membership::from_epochs(map.membership.clone())
            && ms.epochs().len() >= m.membership.epochs().len()
        {
            m.membership = ms;
        }
        let vote = if map.proposal != 0 && map.proposal != m.voted {
            m.voted = map.proposal;
            m.hold = Some(m.next);
            Some((map.proposal, m.next))
        } else {
            if map.proposal != m.voted {
                m.hold = None;
            }
            None
        };
        drop(m);
        self.changed.notify_all();
        vote
    }
}

/// Starts the watcher thread of worker `rank`, which registered with `map`.
pub(crate) fn spawn(cfg: &WorkerConfig, rank: u32, watch: Arc<MapWatch>, map: &JobMap) -> Result<(), WorkerError> {
    // Map polls and votes are answered within a long poll: silence means a dead link.
    let mut ctl = ControlClient::connect(cfg.control.clone(), &cfg.secret, cfg.timeout)?
        .answer_within(eps_control_client::client::ANSWER_WITHIN)?
        .quiet_once(watch.stop.clone());
    // A change proposed before this worker began its first iteration is in the
    // map it registered with, and no newer map may come until it votes.
    let first = watch.observe(map);
    std::thread::spawn(move || {
        if let Some((id, hold)) = first
            && ctl.call(&ControlMsg::Vote { role: Role::Worker, rank, id, hold }).is_err()
        {
            return;
        }
        while !watch.stop.load(Ordering::Relaxed) {
            let have = watch.newest.load(Ordering::Acquire);
            let adopted = watch.adopted.load(Ordering::Acquire);
            let iteration = watch.members.lock().unwrap_or_else(|p| p.into_inner()).next;
            match ctl.call(&ControlMsg::GetMap { worker: rank, adopted, min_epoch: have + 1, iteration }) {
                Ok(ControlMsg::Map(m)) if m.epoch > have => {
                    // The map is stored before a commit lets an iteration
                    // begin: the training thread then routes that iteration
                    // by it (sparse tables need the new bucket map).
                    let e = m.epoch;
                    *watch.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(m.clone());
                    watch.newest.store(e, Ordering::Release);
                    let vote = watch.observe(&m);
                    if let Some((id, hold)) = vote
                        && ctl.call(&ControlMsg::Vote { role: Role::Worker, rank, id, hold }).is_err()
                    {
                        return;
                    }
                }
                Ok(_) => {}
                // The control plane is gone (the job ended) or broken: the data plane
                // goes on; a "moved" answer asks it directly and reports the error.
                Err(_) => return,
            }
        }
    });
    Ok(())
}
