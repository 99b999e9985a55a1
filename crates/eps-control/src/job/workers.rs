//! Workers of a job over its life: ranks, registration, and membership changes.
//!
//! A change of the contributor set (a scale request, or a lease that expired) is
//! decided in two steps so that nobody computes or aggregates an iteration with the
//! wrong set, and nothing on the data path waits for the control plane unless an
//! iteration boundary is reached while a vote is open:
//! 1. a proposal: every member worker and every live server is asked for the first
//!    iteration it has not begun (a worker) or aggregated (a server) yet, and holds
//!    there;
//! 2. once every vote is in, the change is committed at the largest of them, so it
//!    starts at an iteration nobody has begun; the holds are lifted.
//!
//! Workers that join take ranks never used before in the job (servers keep a landing
//! slot per rank, up to `job.max_workers`); workers that leave are the highest ranks.

use std::fmt::Write as _;

use eps_proto::control::{ControlMsg, ErrorCode, Order, Refusal, Role};
use eps_proto::membership::Membership;
use eps_proto::spec::{Consistency, JobSection};

use super::Job;

/// A membership change being voted on.
#[derive(Clone, Debug)]
pub(super) struct Proposal {
    id: u64,
    /// The contributor set from the commit on.
    want: Vec<u32>,
    /// Workers removed because their lease expired.
    expired: Vec<u32>,
    /// Who still has to vote.
    voters: Vec<(Role, u32)>,
    /// The largest hold voted so far.
    hold: u64,
    /// Sparse tables: the bucket map from the commit on (the contributor
    /// set does not change), one owner per bucket.
    pub(super) buckets: Option<Vec<u32>>,
}

/// Worker state by rank.
#[derive(Clone, Debug)]
pub(crate) struct Workers {
    consistency: Consistency,
    limit: u32,
    /// Ranks `0..admitted` have been admitted (initial ones and joins).
    admitted: u32,
    /// Ranks `0..initial` are the job's first workers: they have no lease
    /// until they register (the job waits for them as long as its launcher
    /// says); ranks a scale admitted must register within the join deadline.
    initial: u32,
    registered: Vec<bool>,
    finished: Vec<bool>,
    /// Ranks removed because their lease expired.
    expired: Vec<u32>,
    /// (rank, first iteration of the commit that removed it) for every expiry
    /// committed, for servers that join later.
    pub(crate) lost: Vec<(u32, u64)>,
    /// Committed contributor sets by iteration.
    pub(crate) members: Membership,
    pub(super) proposal: Option<Proposal>,
    proposals: u64,
    /// Changes committed so far.
    pub(crate) changes: u64,
}

impl Workers {
    pub(crate) fn new(job: &JobSection) -> Result<Self, String> {
        let limit = job.rank_limit();
        Ok(Self {
            consistency: job.consistency,
            limit,
            admitted: job.workers,
            initial: job.workers,
            registered: vec![false; limit as usize],
            finished: vec![false; limit as usize],
            expired: Vec::new(),
            lost: Vec::new(),
            members: Membership::new((0..job.workers).collect()).map_err(|e| e.to_string())?,
            proposal: None,
            proposals: 0,
            changes: 0,
        })
    }

    /// Gives the lowest admitted rank not registered yet, or one a proposed
    /// change admits (the worker then waits for the commit).
    pub(crate) fn register(&mut self) -> Result<u32, Refusal> {
        let proposed = self.proposal.as_ref().map_or(&[][..], |p| &p.want[..]);
        let free = |r: u32| !self.registered[r as usize] && !self.finished[r as usize];
        let found = (0..self.admitted).find(|&r| free(r)).or_else(|| proposed.iter().copied().find(|&r| free(r)));
        let Some(r) = found else { return Err(Refusal::new(ErrorCode::Full, self.why_full())) };
        self.registered[r as usize] = true;
        Ok(r)
    }

    /// Why no rank is free for a worker that registers: what each admitted
    /// rank is doing, and what would let one more in.
    fn why_full(&self) -> String {
        let pick = |st: &str| (0..self.admitted).filter(|&r| self.state(r) == st).collect::<Vec<_>>();
        let (running, finished, expired) = (pick("contributing"), pick("finished"), pick("expired"));
        let left = pick("left");
        let mut why =
            format!("every worker rank this job admitted is taken: {} registered and running {running:?}", running.len());
        if !finished.is_empty() {
            why += &format!(", finished {finished:?}");
        }
        if !expired.is_empty() {
            why += &format!(", removed after their lease expired {expired:?}");
        }
        if !left.is_empty() {
            why += &format!(", left {left:?}");
        }
        why += "; ranks are never reused";
        if self.admitted < self.limit {
            why += &format!(
                ". Admit another with `eps scale --workers {}` (job.max_workers allows {})",
                self.members.latest().len() + 1,
                self.limit
            );
        } else {
            why += &format!(". The job may admit no more ranks (job.max_workers = {})", self.limit);
        }
        why
    }

    /// A change is voted on, or admitted ranks have not registered yet.
    pub(crate) fn changing(&self) -> bool {
        self.proposal.is_some() || (0..self.admitted as usize).any(|r| !self.registered[r] && !self.finished[r])
    }

    /// Every admitted worker finished (or was removed).
    pub(crate) fn all_finished(&self) -> bool {
        (0..self.admitted as usize).all(|r| self.finished[r])
    }

    /// Whether worker `rank` may still route pushes (registered, not finished).
    /// What worker `rank` is doing: contributing, admitted (not registered
    /// yet), finished, expired (removed by its lease) or left.
    pub(crate) fn state(&self, rank: u32) -> &'static str {
        let r = rank as usize;
        if self.expired.contains(&rank) {
            "expired"
        } else if r < self.finished.len() && self.finished[r] {
            "finished"
        } else if self.members.latest().contains(&rank) && r < self.registered.len() && self.registered[r] {
            "contributing"
        } else if rank < self.admitted && !self.registered[r] {
            "admitted"
        } else {
            "left"
        }
    }

    /// Ranks admitted so far.
    pub(crate) fn admitted(&self) -> u32 {
        self.admitted
    }

    pub(crate) fn routes(&self, rank: u32) -> bool {
        let r = rank as usize;
        r < self.admitted as usize && self.registered[r] && !self.finished[r]
    }

    /// Id of the proposal being voted on (0 when none).
    pub(crate) fn proposal_id(&self) -> u64 {
        self.proposal.as_ref().map_or(0, |p| p.id)
    }

    /// Ranks whose lease the control plane must watch: registered, unfinished
    /// members of the latest contributor set. A rank that has not registered
    /// has no lease (a process that loads its data for a minute first is not
    /// late); see [`Self::awaited`] for those a scale admitted.
    pub fn leased(&self) -> Vec<u32> {
        let r = |r: u32| r < self.admitted && self.registered[r as usize] && !self.finished[r as usize];
        self.members.latest().iter().copied().filter(|&x| r(x)).collect()
    }

    /// Members a scale admitted that have not registered yet: each must
    /// within the job's join deadline, or it is removed as an expired lease
    /// is (so BSP never waits for a process that died before it registered).
    /// The job's first workers are not here: their launcher bounds the wait.
    pub fn awaited(&self) -> Vec<u32> {
        let r = |r: u32| r >= self.initial && r < self.admitted && !self.registered[r as usize] && !self.finished[r as usize];
        self.members.latest().iter().copied().filter(|&x| r(x)).collect()
    }

    /// Workers that vote on a change: the leased ones that registered (one that
    /// has not starts at the iteration its join names, after any change voted now).
    fn voters(&self) -> Vec<(Role, u32)> {
        self.leased().into_iter().filter(|&r| self.registered[r as usize]).map(|r| (Role::Worker, r)).collect()
    }

    pub(crate) fn status(&self, t: &mut String) {
        let reg = self.registered.iter().filter(|&&x| x).count();
        let fin = self.finished.iter().filter(|&&x| x).count();
        let latest = self.members.latest();
        let _ = writeln!(
            t,
            "workers: {reg}/{} registered, {fin} finished; contributing {:?} from iteration {}; {} membership changes",
            self.admitted,
            latest,
            self.members.epochs().last().map_or(0, |e| e.0),
            self.changes
        );
        let waiting: Vec<u32> =
            (0..self.admitted).filter(|&r| !self.registered[r as usize] && !self.finished[r as usize]).collect();
        if !waiting.is_empty() {
            let _ = writeln!(t, "  ranks {waiting:?} admitted, waiting to register (start them with `eps worker`)");
        }
        if !self.expired.is_empty() {
            let _ = writeln!(t, "  removed after their lease expired: {:?}", self.expired);
        }
        if let Some(p) = &self.proposal {
            let _ = writeln!(t, "  change to {:?} being voted on: {} votes missing", p.want, p.voters.len());
        }
    }
}

impl Job {
    /// `eps scale --workers N`.
    pub(super) fn scale_workers(&mut self, n: u32) -> Result<ControlMsg, Refusal> {
        if n == 0 {
            return Err(Refusal::invalid("a job needs at least one worker"));
        }
        // What needs no change, and what no change could allow, are answered
        // before whether a change may start now.
        let now = self.w.members.latest().to_vec();
        let want: Vec<u32> = if n as usize > now.len() {
            let more = n - now.len() as u32;
            if self.w.admitted.checked_add(more).is_none_or(|all| all > self.w.limit) {
                return Err(Refusal::new(
                    ErrorCode::Limit,
                    format!(
                        "the job may admit {} worker ranks in all (job.max_workers) and has used {}; {more} more do not fit",
                        self.w.limit, self.w.admitted
                    ),
                ));
            }
            now.iter().copied().chain(self.w.admitted..self.w.admitted + more).collect()
        } else {
            now[..n as usize].to_vec()
        };
        if want == now {
            return Ok(ControlMsg::Ok);
        }
        self.can_change_workers()?;
        self.propose(want, Vec::new(), None);
        Ok(ControlMsg::Ok)
    }

    /// Worker `rank` asks to leave the running job: the vote of a scale-down
    /// that removes it (it trains until `begin` says it no longer contributes,
    /// then finishes).
    pub(super) fn leave(&mut self, rank: u32) -> Result<ControlMsg, Refusal> {
        self.can_change_workers()?;
        let now = self.w.members.latest().to_vec();
        if !now.contains(&rank) {
            return Err(Refusal::stale(format!("worker {rank} does not contribute to the job")));
        }
        let want: Vec<u32> = now.iter().copied().filter(|&r| r != rank).collect();
        if want.is_empty() {
            return Err(Refusal::new(ErrorCode::Unsupported, "the job's last worker cannot leave it (it finishes instead)"));
        }
        self.propose(want, Vec::new(), None);
        Ok(ControlMsg::Ok)
    }

    /// Whether the contributor set may change now.
    fn can_change_workers(&self) -> Result<(), Refusal> {
        if self.w.consistency != Consistency::Bsp {
            return Err(Refusal::new(ErrorCode::Unsupported, "changing the workers of a running job needs BSP consistency"));
        }
        if !self.initial_ready() {
            return Err(Refusal::new(ErrorCode::Starting, crate::STILL_STARTING));
        }
        let joining = (0..self.w.admitted as usize).any(|r| !self.w.registered[r] && !self.w.finished[r]);
        let servers_busy = self.migrations_in_flight() > 0
            || self.servers.len() as u32 != self.server_slots
            || self.servers.iter().any(|s| !s.ready && !s.retired);
        if self.w.proposal.is_some() || joining || servers_busy {
            return Err(Refusal::new(
                ErrorCode::ChangeInProgress,
                format!(
                    "{} (workers joining, a vote, or migrations); try again when `eps status` shows none",
                    crate::CHANGE_IN_PROGRESS
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn propose(&mut self, want: Vec<u32>, expired: Vec<u32>, buckets: Option<Vec<u32>>) {
        self.w.proposals += 1;
        let id = self.w.proposals;
        let mut voters = self.w.voters();
        voters.retain(|(_, r)| !expired.contains(r));
        // Every server that may aggregate votes, leaving ones included (they hold
        // shards until their migrations end).
        for r in self.unretired_servers() {
            voters.push((Role::Server, r));
            self.order(r, Order::Propose { id });
        }
        self.w.proposal = Some(Proposal { id, want, expired, voters, hold: 0, buckets });
        self.map.epoch += 1;
        self.try_commit();
    }

    pub(super) fn vote(&mut self, role: Role, rank: u32, id: u64, hold: u64) -> Result<ControlMsg, Refusal> {
        let Some(p) = self.w.proposal.as_mut().filter(|p| p.id == id) else {
            // A vote that crossed the commit (or an expiry that removed the voter).
            return Ok(ControlMsg::Ok);
        };
        p.voters.retain(|v| *v != (role, rank));
        p.hold = p.hold.max(hold);
        self.try_commit();
        Ok(ControlMsg::Ok)
    }

    /// Worker `rank`'s lease expired: it is removed at the next boundary.
    pub(super) fn expire(&mut self, rank: u32) -> Result<ControlMsg, Refusal> {
        if !self.w.leased().contains(&rank) && !self.w.awaited().contains(&rank) {
            return Err(Refusal::stale(format!("worker {rank} holds no lease")));
        }
        self.w.expired.push(rank);
        self.w.finished[rank as usize] = true;
        if self.w.all_finished() && !eps_proto::mutants::active("last-expiry-keeps-job-open") {
            // The last worker the job waited for (the others finished): the
            // job is over; no change of contributors is voted on.
            self.end_if_over();
            return Ok(ControlMsg::Ok);
        }
        let alive: Vec<u32> = self.w.leased();
        match self.w.proposal.as_mut() {
            Some(p) => {
                // A rank the change keeps is gone: keep another live one instead
                // (a scale-down keeps its count with the workers that are left).
                let kept = p.want.len();
                p.want.retain(|&r| r != rank);
                if p.want.len() < kept
                    && let Some(&other) = alive.iter().find(|r| !p.want.contains(r))
                {
                    p.want.push(other);
                    p.want.sort_unstable();
                }
                p.expired.push(rank);
                p.voters.retain(|v| *v != (Role::Worker, rank));
                self.try_commit();
            }
            None => {
                let want: Vec<u32> = self.w.members.latest().iter().copied().filter(|&r| r != rank).collect();
                self.propose(want, vec![rank], None);
            }
        }
        Ok(ControlMsg::Ok)
    }

    pub(super) fn worker_finished(&mut self, rank: u32) -> Result<(), Refusal> {
        let r = rank as usize;
        if r >= self.w.admitted as usize || !self.w.registered[r] {
            return Err(Refusal::invalid(format!("worker rank {rank} is outside the job")));
        }
        self.w.finished[r] = true;
        if let Some(p) = self.w.proposal.as_mut() {
            p.voters.retain(|v| *v != (Role::Worker, rank));
            self.try_commit();
        }
        Ok(())
    }

    /// Server `rank` was lost before it voted on the open proposal: its
    /// shards' new owners (`heirs`) vote again. The lost server may have
    /// aggregated past every vote cast so far, and its promoted backups hold
    /// those versions: the change must come after them.
    pub(super) fn revote_after_loss(&mut self, rank: u32, heirs: &[u32]) {
        let Some(p) = self.w.proposal.as_mut() else { return };
        let before = p.voters.len();
        p.voters.retain(|v| *v != (Role::Server, rank));
        if p.voters.len() == before {
            return; // it had voted, and held from its vote on
        }
        let id = p.id;
        for &h in heirs {
            if !p.voters.contains(&(Role::Server, h)) {
                p.voters.push((Role::Server, h));
            }
        }
        for &h in heirs {
            self.order(h, Order::Propose { id });
        }
        self.try_commit();
    }

    /// Server `rank` retired: it votes on nothing any more.
    pub(super) fn server_retired(&mut self, rank: u32) {
        if let Some(p) = self.w.proposal.as_mut() {
            p.voters.retain(|v| *v != (Role::Server, rank));
            self.try_commit();
        }
    }

    fn try_commit(&mut self) {
        let Some(p) = self.w.proposal.as_ref().filter(|p| p.voters.is_empty()) else { return };
        let p = p.clone();
        self.w.proposal = None;
        if p.want.is_empty() {
            // Every worker is gone: nothing can contribute; the job cannot go on,
            // and `eps status` says so (the expired ranks are listed).
            return;
        }
        let current = self.w.members.epochs().last().map_or(0, |e| e.0);
        let at = p.hold.max(current + 1);
        if let Some(owners) = p.buckets {
            // (The contributor set stays; an expiry during the vote proposes
            // its own change after this one.)
            self.commit_buckets(p.hold, owners);
            self.map.epoch += 1;
            if !p.expired.is_empty() {
                let want = self.w.members.latest().iter().copied().filter(|r| !p.expired.contains(r)).collect();
                self.propose(want, p.expired, None);
            }
            return;
        }
        if self.w.members.schedule(at, at - 1, p.want.clone()).is_err() {
            return;
        }
        self.w.admitted = self.w.admitted.max(p.want.iter().max().map_or(0, |m| m + 1));
        self.w.lost.extend(p.expired.iter().map(|&r| (r, at)));
        self.w.changes += 1;
        for r in self.unretired_servers() {
            self.order(r, Order::Members { at, workers: p.want.clone(), expired: p.expired.clone() });
        }
        self.map.epoch += 1;
    }
}
