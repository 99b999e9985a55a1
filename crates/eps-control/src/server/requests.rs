//! The control plane's answers to requests. An answer that waits (a long poll
//! for a newer map or for orders, the spec before the tensors are declared,
//! an operator's checkpoint) becomes a [`Wait`], tried again whenever the job
//! changes or its deadline passes: one thread serves every connection.

use std::path::Path;
use std::time::{Duration, Instant};

use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, ErrorCode, Refusal, Role};

use super::{LONG_POLL, State};
use crate::ControlError;
use crate::checkpoint::{Outcome, Report, RowsReport, Tracker};
use eps_proto::checkpoint::Manifest;

/// Tries this many versions, each further ahead, before an on-demand
/// checkpoint gives up.
const CHECKPOINT_TRIES: u32 = 10;
/// How long one try waits for the servers' pieces.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(120);

/// A request whose answer waits for the job to change.
#[derive(Debug)]
pub(super) enum Wait {
    /// A worker's map, once the epoch reaches `min_epoch` (or at `deadline`).
    Map { worker: u32, min_epoch: u64, deadline: Instant },
    /// The spec, once the tensors are declared (or at `deadline`).
    Spec { rank: u32, deadline: Instant },
    /// A server's orders after `after`, once there are some (or at `deadline`).
    Orders { rank: u32, after: u64, deadline: Instant },
    /// An operator's checkpoint at `version` (try `attempt`), once complete.
    Checkpoint { dir: String, version: u64, attempt: u32, steps: u64, deadline: Instant, last: String },
}

impl Wait {
    /// When it is tried again even if nothing changed.
    pub(super) fn deadline(&self) -> Instant {
        match self {
            Self::Map { deadline, .. }
            | Self::Spec { deadline, .. }
            | Self::Orders { deadline, .. }
            | Self::Checkpoint { deadline, .. } => *deadline,
        }
    }
}

/// What a request gets: an answer now, or a wait.
#[derive(Debug)]
pub(super) enum Step {
    Reply(ControlMsg),
    Wait(Wait),
}

/// Per connection: the server whose order poll it carries, and whether the
/// answer just given ends the job.
#[derive(Debug, Default)]
pub(super) struct ConnRole {
    pub(super) poller: Option<u32>,
    pub(super) finishes_job: bool,
}

impl State {
    /// Answers `m` (or makes it wait). An error means the state could not be
    /// persisted: the connection closes without an answer.
    pub(super) fn request(&mut self, m: ControlMsg, who: &mut ConnRole) -> Result<Step, ControlError> {
        let reply = match m {
            ControlMsg::Register { .. }
            | ControlMsg::ServerReady { .. }
            | ControlMsg::ShardReady { .. }
            | ControlMsg::BackupReady { .. }
            | ControlMsg::BackupSynced { .. }
            | ControlMsg::Unreplicated { .. }
            | ControlMsg::MoveStopped { .. }
            | ControlMsg::TablesReady { .. }
            | ControlMsg::RowsOut { .. }
            | ControlMsg::RowsTaken { .. }
            | ControlMsg::StandInReady { .. }
            | ControlMsg::RowsBackedUp { .. }
            | ControlMsg::Cutover { .. }
            | ControlMsg::Released { .. }
            | ControlMsg::Split { .. }
            | ControlMsg::Scale { .. }
            | ControlMsg::ScaleWorkers { .. }
            | ControlMsg::Vote { .. }
            | ControlMsg::Declare { .. }
            | ControlMsg::Leave { .. }
            | ControlMsg::Finished { .. }
            | ControlMsg::Once { .. } => {
                if let ControlMsg::Vote { role: Role::Worker, rank, .. } = *m.change() {
                    self.seen.insert(rank, Instant::now());
                }
                match self.job.apply(&m) {
                    Ok(r) => {
                        self.persist(&m)?;
                        if let ControlMsg::MoveStopped { shard, rank } = *m.change() {
                            eps_proto::say_event!(
                                "migration_cancelled",
                                { job = self.name.as_str(), shard = shard, from = rank },
                                "eps control: server {rank} stopped moving shard {shard} (it cannot reach the target); the move is cancelled"
                            );
                        }
                        who.finishes_job = self.job.done();
                        r
                    }
                    Err(refusal) => refusal.into_msg(),
                }
            }
            ControlMsg::Unreachable { rank, by, by_rank } => {
                self.unreachable(rank, (by, by_rank))?;
                ControlMsg::Ok
            }
            ControlMsg::GetMap { worker, adopted, min_epoch, iteration } => {
                // A worker waiting in a long poll is alive: its lease runs from
                // the end of the poll (a worker killed meanwhile never renews it).
                self.seen.insert(worker, Instant::now() + LONG_POLL);
                // Persisted, so that a replay issues the orders that follow
                // from it under the same sequence numbers.
                if let Some(record) = self.job.adopt(worker, adopted) {
                    self.persist(&record)?;
                }
                self.job.worker_progress(worker, iteration);
                return Ok(self.first_try(Wait::Map { worker, min_epoch, deadline: Instant::now() + LONG_POLL }, who));
            }
            // A server registered before the first worker declared the tensors
            // waits for them (long poll).
            ControlMsg::GetSpec { rank } => {
                return Ok(self.first_try(Wait::Spec { rank, deadline: Instant::now() + LONG_POLL }, who));
            }
            ControlMsg::Poll { rank, after } => {
                who.poller = Some(rank);
                self.dropped.remove(&rank);
                self.gone_idle.retain(|&r| r != rank);
                // It carried out the orders up to `after`: they are dropped.
                self.job.orders_polled(rank, after);
                let deadline = Instant::now() + LONG_POLL;
                // Alive while it waits here: its lease runs from the answer.
                self.polled.insert(rank, deadline);
                return Ok(self.first_try(Wait::Orders { rank, after, deadline }, who));
            }
            ControlMsg::StatusJson => ControlMsg::StatusReport { text: self.status_json().to_string() },
            ControlMsg::Status => {
                let mut text = self.health_text() + "\n" + &self.job.status();
                if let Some((v, p)) = &self.last_checkpoint {
                    text += &format!("\ncheckpoint: iteration {v} in {}", p.display());
                }
                ControlMsg::StatusReport { text }
            }
            ControlMsg::Saved { version, start, len, file, sha256, missed, .. } => {
                self.saved(version, &file, |t, rec| {
                    t.saved(&Report { version, start, len, file: &file, sha256: &sha256, missed }, rec)
                });
                ControlMsg::Ok
            }
            ControlMsg::SavedRows { version, table, file, sha256, buckets, changes, missed } => {
                let r = RowsReport { version, table, file: &file, sha256: &sha256, buckets: &buckets, changes, missed };
                self.saved(version, &file, |t, rec| t.saved_rows(&r, rec));
                ControlMsg::Ok
            }
            ControlMsg::Checkpoint { dir, .. } => match self.checkpoint(dir) {
                Ok(w) => return Ok(self.first_try(w, who)),
                Err(refusal) => refusal.into_msg(),
            },
            _ => Refusal::new(ErrorCode::Unexpected, "unexpected message for the control plane").into_msg(),
        };
        Ok(Step::Reply(reply))
    }

    fn first_try(&mut self, mut w: Wait, who: &mut ConnRole) -> Step {
        match self.try_answer(&mut w, who) {
            Some(r) => Step::Reply(r),
            None => Step::Wait(w),
        }
    }

    /// The answer to a waiting request, if it is due (the job changed, or
    /// its deadline passed).
    pub(super) fn try_answer(&mut self, w: &mut Wait, who: &mut ConnRole) -> Option<ControlMsg> {
        let now = Instant::now();
        match w {
            Wait::Map { worker, min_epoch, deadline } => {
                // The first map waits for every initial server (bounded by the
                // client's timeout); later ones answer after the long poll at most.
                let ready = self.job.initial_ready();
                if !ready || (self.job.epoch() < *min_epoch && now < *deadline) {
                    self.seen.insert(*worker, now + LONG_POLL);
                    if !ready {
                        *deadline = now + LONG_POLL;
                    }
                    return None;
                }
                self.seen.insert(*worker, now);
                Some(ControlMsg::Map(self.job.job_map()))
            }
            Wait::Spec { rank, deadline } => (self.job.layout_fixed() || now >= *deadline)
                .then(|| ControlMsg::Registered { rank: *rank, spec_toml: self.job.spec_text().to_string() }),
            Wait::Orders { rank, after, deadline } => {
                if self.job.lost_servers().contains(rank) {
                    // Fenced off: its shards are served by their backups now.
                    who.poller = None;
                    return Some(ControlMsg::Error {
                        code: ErrorCode::Lost,
                        message: format!("server {rank} was declared lost and its shards' backups serve them now; it must stop"),
                    });
                }
                let (last, orders) = self.job.orders_for(*rank, *after);
                if orders.is_empty() && now < *deadline {
                    return None;
                }
                self.polled.insert(*rank, now);
                Some(ControlMsg::Orders { last, orders })
            }
            Wait::Checkpoint { dir, version, attempt, steps, deadline, last } => {
                match self.ckpt.outcome(Path::new(dir.as_str()), *version) {
                    Outcome::Complete(p) => {
                        return Some(ControlMsg::Checkpointed { version: *version, path: p.display().to_string() });
                    }
                    Outcome::Failed(why) => *last = format!(" (last try: {why})"),
                    Outcome::Pending if now < *deadline => return None,
                    Outcome::Pending => {
                        let message =
                            format!("the servers did not save iteration {version} within {} s", CHECKPOINT_WAIT.as_secs());
                        return Some(ControlMsg::Error { code: ErrorCode::Checkpoint, message });
                    }
                }
                // A server had passed it: further ahead.
                *attempt += 1;
                if *attempt == CHECKPOINT_TRIES {
                    let message = format!("no checkpoint after {CHECKPOINT_TRIES} tries{last}");
                    return Some(ControlMsg::Error { code: ErrorCode::Checkpoint, message });
                }
                let (d, s, a, l) = (std::mem::take(dir), *steps, *attempt, std::mem::take(last));
                match self.checkpoint_try(d, s, a, l) {
                    Ok(next) => {
                        *w = next;
                        self.try_answer(w, who)
                    }
                    Err(refusal) => Some(refusal.into_msg()),
                }
            }
        }
    }

    /// A server saved its piece (or table rows, in `file`) of the checkpoint
    /// at `version`: `take` hands the report to the tracker.
    fn saved(&mut self, version: u64, file: &str, take: impl FnOnce(&mut Tracker, &Manifest) -> Outcome) {
        // (A file of an earlier checkpoint is in the same job directory.)
        let before = Path::new(file).parent().and_then(Path::parent).map(|d| self.ckpt.outcome(d, version));
        let rec = self.job.checkpoint_record(version);
        match take(&mut self.ckpt, &rec) {
            Outcome::Complete(p) if before != Some(Outcome::Complete(p.clone())) => {
                eps_proto::say!("eps control: checkpoint at iteration {version} complete in {}", p.display());
                if self.last_checkpoint.as_ref().is_none_or(|(v, _)| *v < version) {
                    self.last_checkpoint = Some((version, p));
                }
            }
            Outcome::Failed(why) if before == Some(Outcome::Pending) => {
                eps_proto::say!("eps control: the checkpoint at iteration {version} is abandoned: {why}");
            }
            _ => {}
        }
    }

    /// An operator's checkpoint: orders every server to save at a version no
    /// worker has reached (as far as their last reports tell), waits for the
    /// pieces, and tries further ahead when a server had passed it.
    fn checkpoint(&mut self, dir: String) -> Result<Wait, Refusal> {
        let spec = JobSpec::from_toml(self.job.spec_text()).ok();
        let dir = if dir.is_empty() { spec.as_ref().and_then(|s| s.job.checkpoint_dir.clone()).unwrap_or_default() } else { dir };
        if dir.is_empty() {
            return Err(Refusal::invalid("give a directory: the job's spec names no checkpoint_dir"));
        }
        if !Path::new(&dir).is_absolute() {
            return Err(Refusal::invalid(format!("{dir}: give an absolute directory (servers may run elsewhere)")));
        }
        if !self.job.initial_ready() {
            return Err(Refusal::new(ErrorCode::Starting, crate::STILL_STARTING));
        }
        let steps = spec.map_or(u64::MAX, |s| s.job.steps);
        self.checkpoint_try(dir, steps, 0, String::new())
    }

    fn checkpoint_try(&mut self, dir: String, steps: u64, attempt: u32, last: String) -> Result<Wait, Refusal> {
        let version = self.job.furthest_iteration() + (8 << attempt);
        if version >= steps {
            let message = format!("the job ends (iteration {steps}) before a checkpoint could be taken{last}");
            return Err(Refusal::new(ErrorCode::Checkpoint, message));
        }
        let rec = ControlMsg::Checkpoint { version, dir: dir.clone() };
        self.job.apply(&rec)?;
        self.persist(&rec)
            .map_err(|e| Refusal::new(ErrorCode::Checkpoint, format!("cannot persist the checkpoint order: {e}")))?;
        Ok(Wait::Checkpoint { dir, version, attempt, steps, deadline: Instant::now() + CHECKPOINT_WAIT, last })
    }
}
