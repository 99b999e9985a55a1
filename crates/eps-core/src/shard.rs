//! One held shard: its consistency state and the updates parked until it is
//! free, and the decisions on what workers send it.

use std::borrow::Cow;
use std::collections::VecDeque;

use eps_proto::migrate::Source;
use eps_proto::sync::{PushOutcome, ShardSync, SyncError};

use crate::Members;

/// An update waiting for its shard to be free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pending {
    /// Workers' contributions of an iteration: all (BSP), or one worker's
    /// (SSP/ASP).
    Update {
        /// The iteration.
        iteration: u64,
        /// SSP/ASP: whose contribution.
        one: Option<u32>,
    },
    /// A forwarded update producing `version` (a migration target or a
    /// backup); `carry`: an iteration without contributions (the parameters
    /// carry over); `worker`: in SSP/ASP, the worker whose contribution it is
    /// (the version is not checked).
    Forward {
        /// The version it produces.
        version: u64,
        /// Without contributions.
        carry: bool,
        /// SSP/ASP: whose contribution.
        worker: Option<u32>,
    },
}

/// An update that cannot run as asked: a bug in its caller or a peer that
/// broke the protocol.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// A BSP update of another iteration than the shard's version.
    #[error("iteration {iteration} aggregated at version {version}")]
    WrongIteration {
        /// The update's iteration.
        iteration: u64,
        /// The shard's version.
        version: u64,
    },
    /// A forward of another version than the next.
    #[error("forward of version {got} applied at version {at}")]
    WrongForward {
        /// The forward's version.
        got: u64,
        /// The shard's version.
        at: u64,
    },
    /// A migration target acknowledged another version than the one in
    /// flight (or none was).
    #[error("acknowledgement of version {got}, {}", match sent { Some(v) => format!("version {v} in flight"), None => "nothing in flight".to_string() })]
    WrongAck {
        /// What it acknowledged.
        got: u64,
        /// The version in flight.
        sent: Option<u64>,
    },
    /// A backup told it has no backup of its own (only an owner has one).
    #[error("told it has no backup, but it is one")]
    NotOwner,
}

/// What an update consumes and produces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan<'a> {
    /// The version it produces.
    pub next: u64,
    /// Whose landing slots it sums, in rank order (empty for a forward).
    pub contributors: Cow<'a, [u32]>,
    /// SSP/ASP: the one contribution it applies.
    pub one: Option<u32>,
    /// Nothing to apply: the parameters carry over (an iteration whose every
    /// contributor was removed, or a forward of one).
    pub carry: bool,
}

/// The next parked update, when asked to drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Apply it now.
    Apply(Pending),
    /// Nothing is parked and the shard is free (a split waiting for it may run).
    Idle,
    /// The shard is not free.
    Busy,
}

/// What a pull request leads to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PullStep {
    /// Not served here (any more, or not yet): answer "pull moved".
    Moved,
    /// Write version `v` now.
    Send(u64),
    /// Answered once the version is published.
    Wait,
}

/// What a server does with a worker's push of an iteration to a shard it
/// holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushGate {
    /// The shard is migrating away and the push belongs to the target (an
    /// iteration at or past the cutover, or a BSP push ahead of the source's
    /// version, which comes from a worker that pulled the next version from
    /// the target): answer "moved".
    Moved,
    /// A promoted backup's shard pushed again for an iteration it already
    /// applied (its worker pushed it again after the owner was lost): the
    /// worker's pull is answered; nothing is applied twice.
    AlreadyApplied,
    /// Take it ([`ShardCore::take_push`]).
    Take,
}

/// Decides on a push of `iteration` to a shard in state `sync`; `source` is
/// the shard's migration source side, if it migrates away; `promoted`
/// whether the shard is a backup's (promoted or to be).
pub fn push_gate(bsp: bool, sync: &ShardSync, source: Option<&Source>, promoted: bool, iteration: u64) -> PushGate {
    let future = bsp && iteration > sync.version();
    if source.is_some_and(|s| future || s.accepts_push(iteration).is_err()) {
        return PushGate::Moved;
    }
    if promoted && iteration < sync.version() && !eps_proto::mutants::active("promoted-backup-reapplies") {
        return PushGate::AlreadyApplied;
    }
    PushGate::Take
}

/// One held shard.
#[derive(Clone, Debug)]
pub struct ShardCore {
    /// Its consistency state.
    pub sync: ShardSync,
    /// Updates waiting for the shard to be free, in arrival order.
    waiting: VecDeque<Pending>,
}

impl ShardCore {
    /// A shard in state `sync`, nothing parked.
    pub fn new(sync: ShardSync) -> Self {
        Self { sync, waiting: VecDeque::new() }
    }

    /// How many are parked.
    pub fn parked_len(&self) -> usize {
        self.waiting.len()
    }

    /// Forwards parked (a target's next forward is the version after them).
    pub fn forwards_parked(&self) -> u64 {
        self.waiting.iter().filter(|p| matches!(p, Pending::Forward { .. })).count() as u64
    }

    /// Parks `ps` after what is parked (contributions held back by a
    /// checkpoint's cut).
    pub fn park_all(&mut self, ps: impl IntoIterator<Item = Pending>) {
        self.waiting.extend(ps);
        self.sync.set_publish_waiting(!self.waiting.is_empty());
    }

    /// Takes every parked update out (a source relaying after its cutover).
    pub fn unpark_all(&mut self) -> Vec<Pending> {
        self.sync.set_publish_waiting(false);
        self.waiting.drain(..).collect()
    }

    /// Whether the next update may run now; `busy`: a snapshot or forward of
    /// the shard is in flight (to a move's target or a backup), which reads
    /// the shard's buffers.
    pub fn free(&self, busy: bool) -> bool {
        self.sync.can_publish() && self.waiting.is_empty() && !busy
    }

    /// An update is due: returns it when it may run now, else parks it (an
    /// iteration found complete again while parked is parked once).
    pub fn offer(&mut self, p: Pending, busy: bool) -> Option<Pending> {
        if self.free(busy) {
            return Some(p);
        }
        self.sync.set_publish_waiting(true);
        let again = matches!(p, Pending::Update { one: None, iteration }
            if self.waiting.iter().any(|q| matches!(q, Pending::Update { one: None, iteration: i } if *i == iteration)));
        if !again {
            self.waiting.push_back(p);
        }
        None
    }

    /// The next parked update to run, if the shard is free for it.
    pub fn next(&mut self, busy: bool) -> Next {
        if !self.sync.can_publish() || busy {
            return Next::Busy;
        }
        let Some(p) = self.waiting.pop_front() else { return Next::Idle };
        self.sync.set_publish_waiting(!self.waiting.is_empty());
        Next::Apply(p)
    }

    /// What update `p` consumes and produces, checked against the shard's
    /// version: a BSP update is of the iteration the shard is at, a forward
    /// (but SSP/ASP's, which are not numbered) produces the next version.
    pub fn plan<'a>(&self, p: Pending, members: &'a Members) -> Result<Plan<'a>, CoreError> {
        let version = self.sync.version();
        let next = version + 1;
        let (contributors, one) = match p {
            Pending::Update { iteration, one: None } => {
                if iteration != version {
                    return Err(CoreError::WrongIteration { iteration, version });
                }
                (members.contributors(&self.sync, iteration), None)
            }
            Pending::Update { one: Some(w), .. } => (Cow::Borrowed(std::slice::from_ref(&crate::ALL_RANKS[w as usize])), Some(w)),
            Pending::Forward { version: got, worker: None, .. } if got != next => {
                return Err(CoreError::WrongForward { got, at: version });
            }
            Pending::Forward { .. } => (Cow::Borrowed(&[][..]), None),
        };
        let carry =
            matches!(p, Pending::Forward { carry: true, .. } | Pending::Update { one: None, .. }) && contributors.is_empty();
        Ok(Plan { next, contributors, one, carry })
    }

    /// Update `p` was applied (and, replicated, its backup has it): the new
    /// version is served. Pulls it readies are taken with
    /// `ShardSync::ready_pulls` once the caller has done what follows an
    /// update (forwards to a move's target).
    pub fn finished(&mut self, p: Pending) -> u64 {
        let before = self.sync.version();
        let v = match p {
            Pending::Forward { worker: Some(w), .. } => self.sync.forwarded_from(w),
            Pending::Forward { .. } => self.sync.forwarded(),
            Pending::Update { one, .. } => self.sync.published(one),
        };
        // Versions only move forward, one update at a time.
        assert_eq!(v, before + 1, "an update of version {before} produced {v}");
        self.sync.set_publish_waiting(!self.waiting.is_empty());
        v
    }

    /// Takes worker `w`'s push of `iteration` (its data has landed): the
    /// update it completes, if any. While a vote holds the iteration, a BSP
    /// push is only recorded (the iteration's contributors are not settled).
    /// An SSP/ASP push is applied on its own whatever is voted on: no
    /// contributor set waits for the vote (an SSP/ASP vote is on the buckets
    /// of sparse tables, whose requests their gate holds), and a push only
    /// recorded would count in the worker's clock, answering pulls without
    /// it, and never be applied.
    pub fn take_push(&mut self, members: &Members, w: u32, iteration: u64) -> Result<Option<Pending>, SyncError> {
        let bsp = self.sync.mode() == eps_proto::Consistency::Bsp;
        if (bsp || eps_proto::mutants::active("ssp-push-held-by-bucket-vote")) && members.unsettled(iteration) {
            return self.sync.on_push_unsettled(w, iteration).map(|()| None);
        }
        let contributors = members.contributors(&self.sync, iteration);
        Ok(match self.sync.on_push(w, iteration, &contributors)? {
            PushOutcome::Wait => None,
            PushOutcome::AggregateAll { iteration } => Some(Pending::Update { iteration, one: None }),
            PushOutcome::ApplyOne { worker, iteration } => Some(Pending::Update { iteration, one: Some(worker) }),
        })
    }

    /// The BSP update due now, if the shard's iteration has every
    /// contribution it expects and its contributor set is settled. (The
    /// caller does not ask while an applied update waits for its backup's
    /// acknowledgement: its slots are not freed yet.)
    pub fn completes(&self, members: &Members) -> Option<Pending> {
        members.complete(&self.sync).map(|(iteration, _)| Pending::Update { iteration, one: None })
    }

    /// Worker `w` asks for version `need` or later; `refused`: a migration
    /// under way no longer serves it here.
    pub fn pull(&mut self, w: u32, need: u64, refused: bool) -> Result<PullStep, SyncError> {
        if refused || !self.sync.serves(need) {
            return Ok(PullStep::Moved);
        }
        Ok(match self.sync.on_pull(w, need)? {
            Some(v) => PullStep::Send(v),
            None => PullStep::Wait,
        })
    }

    /// The BSP cutover a migration source announces once its snapshot is
    /// written (see `eps_proto::migrate::cutover_at`): the iteration after if
    /// this one's update is ready here, else the snapshot's version.
    pub fn cutover_at(&self, members: &Members, wire_elem_bytes: u64) -> u64 {
        let version = self.sync.version();
        let c = members.contributors(&self.sync, version);
        let complete = self.sync.complete(&c).is_some() || !self.waiting.is_empty();
        eps_proto::migrate::cutover_at(version, complete, c.len(), wire_elem_bytes)
    }

    /// SSP/ASP: the clocks a migration's snapshot carries: the contributions
    /// received from each worker, less those parked (they are not in the
    /// snapshot's values; the relay sends them after it).
    pub fn snapshot_clocks(&self) -> Vec<u64> {
        let mut clocks = self.sync.clocks().to_vec();
        for p in &self.waiting {
            if let Pending::Update { one: Some(w), .. } = p
                && let Some(c) = clocks.get_mut(*w as usize)
            {
                *c = c.saturating_sub(1);
            }
        }
        clocks
    }

    /// SSP/ASP: the source's snapshot landed: it stops applying. Returns the
    /// relay, with the contributions parked meanwhile, and the workers whose
    /// waiting pulls go back ("pull moved": the target answers them).
    pub fn cut_over_async(&mut self) -> (crate::Relay, Vec<u32>) {
        let parked = self.unpark_all().into_iter().filter_map(|p| match p {
            Pending::Update { one: Some(w), .. } => Some(w),
            _ => None,
        });
        let relay = crate::Relay::new(parked);
        (relay, self.sync.refuse_all())
    }

    /// Cuts over at `at` on the source: returns the workers whose held pushes
    /// go back ("moved": they push again to the target) and those whose
    /// waiting pulls do ("pull moved"). At the snapshot's own version, a
    /// complete iteration parked here goes back with its pushes.
    pub fn cut_over(&mut self, at: u64) -> (Vec<u32>, Vec<u32>) {
        let version = self.sync.version();
        let back = if at > version { (Vec::new(), self.sync.refuse_above(at)) } else { self.sync.evict() };
        if at == version {
            self.waiting.retain(|p| !matches!(p, Pending::Update { .. }));
            self.sync.set_publish_waiting(!self.waiting.is_empty());
        }
        back
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MembersError;
    use eps_proto::Consistency;

    #[test]
    fn pushes_go_where_the_iteration_is_served_and_are_applied_once() {
        let mut s = ShardSync::new(Consistency::Bsp, 2);
        s.snapshot_landed(4);
        assert_eq!(push_gate(true, &s, None, false, 4), PushGate::Take);
        // A source cutting over at 5 takes 4, not 5; in BSP not 5 before it holds 5.
        let mut src = Source::start(4);
        assert_eq!(push_gate(true, &s, Some(&src), false, 5), PushGate::Moved);
        src.announce(5).unwrap();
        assert_eq!(push_gate(true, &s, Some(&src), false, 4), PushGate::Take);
        assert_eq!(push_gate(false, &s, Some(&src), false, 5), PushGate::Moved);
        // A promoted backup at version 4 ignores a re-push of 3, takes 4.
        assert_eq!(push_gate(true, &s, None, true, 3), PushGate::AlreadyApplied);
        assert_eq!(push_gate(true, &s, None, true, 4), PushGate::Take);
        assert_eq!(push_gate(true, &s, None, false, 3), PushGate::Take, "not a backup: ShardSync refuses it");
    }

    #[test]
    fn an_iteration_runs_once_all_its_pushes_landed_and_parks_while_the_shard_is_busy() {
        let members = Members::new(2).unwrap();
        let mut s = ShardCore::new(ShardSync::new(Consistency::Bsp, 2));
        assert_eq!(s.take_push(&members, 1, 0), Ok(None));
        let due = s.take_push(&members, 0, 0).unwrap().expect("both pushes in");
        assert_eq!(due, Pending::Update { iteration: 0, one: None });
        assert_eq!(s.offer(due, true), None, "busy: parked");
        assert_eq!(s.offer(due, true), None, "found complete again: parked once");
        assert_eq!(s.parked_len(), 1);
        assert_eq!(s.next(true), Next::Busy);
        assert_eq!(s.next(false), Next::Apply(due));
        let plan = s.plan(due, &members).unwrap();
        assert_eq!((plan.next, &*plan.contributors, plan.carry), (1, &[0, 1][..], false));
        assert_eq!(s.finished(due), 1);
        assert_eq!(s.next(false), Next::Idle);
        assert_eq!(s.plan(due, &members), Err(CoreError::WrongIteration { iteration: 0, version: 1 }));
    }

    #[test]
    fn a_vote_holds_pushes_until_its_commit_and_a_lost_worker_is_not_awaited() {
        let mut members = Members::new(2).unwrap();
        let mut s = ShardCore::new(ShardSync::new(Consistency::Bsp, 2));
        assert_eq!(members.propose(Members::reach(Consistency::Bsp, &s.sync)), 1);
        assert_eq!(s.take_push(&members, 0, 0).unwrap(), None);
        let due = s.offer(Pending::Update { iteration: 0, one: None }, false).unwrap();
        s.finished(due);
        assert_eq!(s.take_push(&members, 0, 1), Ok(None), "held by the vote");
        assert_eq!(s.completes(&members), None);
        members.commit(1, vec![0], &[1], 2).unwrap();
        assert_eq!(members.hold(), None);
        assert_eq!(s.completes(&members), Some(Pending::Update { iteration: 1, one: None }));
        assert!(matches!(members.commit(3, vec![0, 2], &[], 2), Err(MembersError::RankBeyondLimit { .. })));
    }

    #[test]
    fn pulls_wait_for_their_version_and_a_source_past_its_cutover_refuses_them() {
        let members = Members::new(1).unwrap();
        let mut s = ShardCore::new(ShardSync::new(Consistency::Bsp, 1));
        assert_eq!(s.pull(0, 1, false), Ok(PullStep::Wait));
        let due = s.take_push(&members, 0, 0).unwrap().unwrap();
        let due = s.offer(due, false).unwrap();
        s.finished(due);
        let mut ready = Vec::new();
        s.sync.ready_pulls(&mut ready);
        assert_eq!(ready, vec![(0, 1)]);
        s.sync.pull_written(1);
        assert_eq!(s.pull(0, 1, true), Ok(PullStep::Moved));
        assert_eq!(s.cutover_at(&members, 4), 1, "nothing of iteration 1 here: cut over at the snapshot's version");
    }
}
