//! The control-plane service: assigns ranks, hands out the spec, and serves the job
//! state of [`crate::job::Job`]: the shard map to workers (long polls that answer
//! when the epoch moves), orders to servers (long polls too), scale requests, and
//! the reports of migrations. Every state change is persisted before it is
//! acknowledged.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use eps_fabric::Secret;
use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, Role};

use crate::ControlError;
use crate::checkpoint::{Outcome, Report, Tracker};
use crate::conn::{auth_server, read_msg, write_msg};
use crate::job::Job;
use crate::store::Store;

/// Marks the spec record in the store.
const SPEC_RECORD_RANK: u32 = u32::MAX;

/// How long a server's dropped order poll may stay away before it is lost.
const SERVER_GRACE: Duration = Duration::from_millis(1500);

/// Reports that a server is unreachable count together within this.
const UNREACHABLE_WINDOW: Duration = Duration::from_secs(30);

/// How long a long poll (map or orders) waits for news before answering anyway.
const LONG_POLL: Duration = Duration::from_millis(500);

struct State {
    job: Job,
    /// When each worker rank last reached the control plane (its lease).
    seen: HashMap<u32, Instant>,
    lease: Duration,
    /// Set once the reply to the last `Finished` has been written: only then may the
    /// service exit (exiting earlier would cut that reply off).
    done_replied: bool,
    store: Box<dyn Store>,
    /// Checkpoints being collected and completed.
    ckpt: Tracker,
    /// The newest complete checkpoint: its version and directory.
    last_checkpoint: Option<(u64, PathBuf)>,
    /// Servers whose order poll connection dropped, and when.
    dropped: HashMap<u32, Instant>,
    /// When each server's order poll last reached the control plane (its lease).
    polled: HashMap<u32, Instant>,
    /// Servers reported unreachable (a data connection cut while they poll):
    /// who reported each, and when first.
    unreachable: HashMap<u32, (Vec<(Role, u32)>, Instant)>,
    server_lease: Duration,
}

impl State {
    fn persist(&mut self, m: &ControlMsg) -> Result<(), ControlError> {
        self.store.append(&m.encode()[4..]).map_err(ControlError::Store)
    }

    /// Declares lost the servers whose order poll dropped and did not come
    /// back within `SERVER_GRACE`, or stopped coming for the server lease
    /// (a job with replicas promotes their backups). Returns whether anything
    /// changed.
    fn lose_servers(&mut self) -> Result<bool, ControlError> {
        let now = Instant::now();
        let mut gone: Vec<(u32, String)> = self
            .dropped
            .iter()
            .filter(|(_, t)| now.duration_since(**t) > SERVER_GRACE)
            .map(|(r, _)| (*r, format!("its connection dropped {} ms ago", SERVER_GRACE.as_millis())))
            .collect();
        gone.extend(
            self.polled
                .iter()
                .filter(|(r, t)| now > **t && now.duration_since(**t) > self.server_lease && !self.dropped.contains_key(r))
                .map(|(r, t)| (*r, format!("it has not polled for orders for {} ms", now.duration_since(*t).as_millis()))),
        );
        let mut changed = false;
        for (r, why) in gone {
            self.dropped.remove(&r);
            self.polled.remove(&r);
            changed |= self.declare_lost(r, &why)?;
        }
        Ok(changed)
    }

    /// Declares server `rank` lost (`why`), in a job with replicas that it
    /// still serves: its backups take over (a record of the store).
    fn declare_lost(&mut self, rank: u32, why: &str) -> Result<bool, ControlError> {
        if !self.job.replicated() || !self.job.server_serving(rank) || self.job.done() {
            return Ok(false);
        }
        let m = ControlMsg::ServerLost { rank };
        if self.job.apply(&m).is_err() {
            return Ok(false);
        }
        self.forget_reports_of(rank);
        eprintln!("eps control: server {rank} is lost ({why}); its shards' backups take over");
        self.persist(&m)?;
        Ok(true)
    }

    /// Peer `by` cannot reach server `rank`. Two peers saying so (or a job's
    /// only worker) make it lost, in a job with replicas: its backups take
    /// over and it is fenced off. One peer alone may be the broken end: it
    /// gives up on its own (a worker leaves the job). Returns whether anything
    /// changed.
    fn unreachable(&mut self, rank: u32, by: (Role, u32)) -> Result<bool, ControlError> {
        let now = Instant::now();
        self.unreachable.retain(|_, (_, first)| now.duration_since(*first) < UNREACHABLE_WINDOW);
        if !self.job.replicated() || !self.job.server_serving(rank) || self.job.done() || by == (Role::Server, rank) {
            return Ok(false); // (nothing to declare: see `declare_lost`)
        }
        if by.0 == Role::Server && !self.job.server_serving(by.1) {
            // A lost server's connections fail as it goes: its word is void.
            return Ok(false);
        }
        let (who, _) = self.unreachable.entry(rank).or_insert_with(|| (Vec::new(), now));
        if !who.contains(&by) {
            who.push(by);
        }
        let alone = by.0 == Role::Worker && self.job.leased_workers().len() == 1;
        if who.len() < 2 && !alone {
            eprintln!("eps control: {:?} {} cannot reach server {rank} (one report: not declared lost yet)", by.0, by.1);
            return Ok(false);
        }
        let reporters: Vec<String> = who.iter().map(|(r, n)| format!("{r:?} {n}").to_lowercase()).collect();
        self.declare_lost(rank, &format!("{} cannot reach it", reporters.join(" and ")))
    }

    /// Server `rank` is lost: reports about it are moot, and its own go (cut
    /// off, it found its peers unreachable too).
    fn forget_reports_of(&mut self, rank: u32) {
        self.unreachable.remove(&rank);
        for (who, _) in self.unreachable.values_mut() {
            who.retain(|w| *w != (Role::Server, rank));
        }
    }

    /// Removes workers whose lease ran out (a worker renews it with every map
    /// request, which its watcher thread makes at least every long poll). Returns
    /// whether anything changed.
    fn expire_leases(&mut self) -> Result<bool, ControlError> {
        let now = Instant::now();
        let mut changed = false;
        for r in self.job.leased_workers() {
            let seen = *self.seen.entry(r).or_insert(now);
            if now.duration_since(seen) > self.lease {
                let m = ControlMsg::Expire { rank: r };
                if self.job.apply(&m).is_ok() {
                    eprintln!(
                        "eps control: worker {r} has not renewed its lease for {} ms; removing it at the next iteration boundary",
                        now.duration_since(seen).as_millis()
                    );
                    self.persist(&m)?;
                    changed = true;
                }
            }
        }
        Ok(changed)
    }
}

/// A running control plane.
pub struct ControlService {
    listener: TcpListener,
    secret: Secret,
    shared: Arc<(Mutex<State>, Condvar)>,
}

impl std::fmt::Debug for ControlService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlService").field("addr", &self.listener.local_addr().ok()).finish()
    }
}

impl ControlService {
    /// Binds `addr` for `spec` (whose TOML text is `spec_text`), replaying `store`.
    pub fn bind(
        addr: SocketAddr,
        spec: &JobSpec,
        spec_text: &str,
        secret: Secret,
        store: Box<dyn Store>,
    ) -> Result<Self, ControlError> {
        let listener = TcpListener::bind(addr).map_err(|e| ControlError::Bind { addr, source: e })?;
        let spec_record = ControlMsg::Registered { rank: SPEC_RECORD_RANK, spec_toml: spec_text.to_string() };
        let job = Job::new(spec, spec_text).map_err(|_| ControlError::Protocol("the job spec has no valid layout"))?;
        let lease = Duration::from_millis(spec.job.worker_lease_ms);
        let ckpt = Tracker::new(spec.job.checkpoint_keep);
        let mut st = State {
            job,
            seen: HashMap::new(),
            lease,
            done_replied: false,
            store,
            ckpt,
            last_checkpoint: None,
            dropped: HashMap::new(),
            polled: HashMap::new(),
            unreachable: HashMap::new(),
            server_lease: Duration::from_millis(spec.job.server_lease_ms),
        };
        // The store's records replayed one by one: the spec's first.
        let (mut first, mut why) = (true, None);
        let State { store, job, .. } = &mut st;
        let replayed = store.replay(&mut |r| {
            let m = ControlMsg::decode(r);
            why = match (m, std::mem::take(&mut first)) {
                (Err(_), _) => Some("corrupt record in the control store"),
                (Ok(m), true) => (m != spec_record).then_some("the state directory belongs to a job with another spec"),
                (Ok(m), false) => job.apply(&m).err().map(|_| "the control store does not replay"),
            };
            why.map_or(Ok(()), |w| Err(w.to_string()))
        });
        match replayed.map_err(ControlError::Store)? {
            Ok(0) => st.store.append(&spec_record.encode()[4..]).map_err(ControlError::Store)?,
            Ok(_) => {}
            Err(_) => return Err(ControlError::Protocol(why.unwrap_or("the control store does not replay"))),
        }
        // A replayed job that had already finished has nothing left to serve.
        st.done_replied = st.job.done();
        Ok(Self { listener, secret, shared: Arc::new((Mutex::new(st), Condvar::new())) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound")
    }

    /// Serves until every server and worker has reported `Finished`.
    pub fn run(self) -> Result<(), ControlError> {
        self.run_until(&AtomicBool::new(false))
    }

    /// As [`ControlService::run`], or until `stop` is set (a host process
    /// shutting down an embedded job: connections already open are served
    /// until their peers close them).
    pub fn run_until(self, stop: &AtomicBool) -> Result<(), ControlError> {
        self.listener.set_nonblocking(true).map_err(ControlError::Io)?;
        loop {
            if stop.load(Ordering::Acquire) {
                return Ok(());
            }
            {
                let mut st = self.shared.0.lock().unwrap_or_else(|p| p.into_inner());
                if st.done_replied {
                    return Ok(());
                }
                if st.expire_leases()? | st.lose_servers()? {
                    self.shared.1.notify_all();
                }
            }
            match self.listener.accept() {
                Ok((s, _)) => {
                    let shared = self.shared.clone();
                    let secret = self.secret.clone();
                    std::thread::spawn(move || {
                        let _ = serve(s, &secret, &shared);
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(ControlError::Io(e)),
            }
        }
    }
}

fn serve(mut s: TcpStream, secret: &Secret, shared: &(Mutex<State>, Condvar)) -> Result<(), ControlError> {
    s.set_nonblocking(false).map_err(ControlError::Io)?;
    auth_server(&mut s, secret)?;
    let (lock, cv) = shared;
    let locked = || lock.lock().unwrap_or_else(|p| p.into_inner());
    // The server whose order poll this connection carries, if any.
    let mut poller: Option<u32> = None;
    loop {
        let m = match read_msg(&mut s) {
            Ok(m) => m,
            Err(e) => {
                if let Some(r) = poller {
                    locked().dropped.insert(r, Instant::now());
                }
                return Err(e);
            }
        };
        let mut finishes_job = false;
        let reply = match m {
            ControlMsg::Register { .. }
            | ControlMsg::ServerReady { .. }
            | ControlMsg::ShardReady { .. }
            | ControlMsg::BackupReady { .. }
            | ControlMsg::BackupSynced { .. }
            | ControlMsg::Unreplicated { .. }
            | ControlMsg::Cutover { .. }
            | ControlMsg::Released { .. }
            | ControlMsg::Split { .. }
            | ControlMsg::Scale { .. }
            | ControlMsg::ScaleWorkers { .. }
            | ControlMsg::Vote { .. }
            | ControlMsg::Declare { .. }
            | ControlMsg::Leave { .. }
            | ControlMsg::Finished { .. } => {
                let mut st = locked();
                if let ControlMsg::Vote { role: eps_proto::control::Role::Worker, rank, .. } = m {
                    st.seen.insert(rank, Instant::now());
                }
                match st.job.apply(&m) {
                    Ok(r) => {
                        st.persist(&m)?;
                        cv.notify_all();
                        finishes_job = st.job.done();
                        r
                    }
                    Err(message) => ControlMsg::Error { message },
                }
            }
            ControlMsg::Unreachable { rank, by, by_rank } => {
                let mut st = locked();
                if st.unreachable(rank, (by, by_rank))? {
                    cv.notify_all();
                }
                ControlMsg::Ok
            }
            ControlMsg::GetMap { worker, adopted, min_epoch, iteration } => {
                let mut st = locked();
                // A worker waiting in a long poll is alive: its lease runs from
                // the end of the poll (a worker killed meanwhile never renews it).
                st.seen.insert(worker, Instant::now() + LONG_POLL);
                if st.job.adopts_newer(worker, adopted) {
                    // Persisted, so that a replay issues the orders that follow
                    // from it under the same sequence numbers.
                    let record = ControlMsg::GetMap { worker, adopted, min_epoch: 0, iteration: 0 };
                    let _ = st.job.apply(&record);
                    st.persist(&record)?;
                }
                st.job.worker_progress(worker, iteration);
                // Orders may follow (a drained server may now retire).
                cv.notify_all();
                let deadline = Instant::now() + LONG_POLL;
                // The first map waits for every initial server (bounded by the
                // client's timeout); later ones answer after the long poll at most.
                while !st.job.initial_ready() || (st.job.epoch() < min_epoch && Instant::now() < deadline) {
                    let wait =
                        if st.job.initial_ready() { deadline.saturating_duration_since(Instant::now()) } else { LONG_POLL };
                    st = cv.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()).0;
                    st.seen.insert(worker, Instant::now() + LONG_POLL);
                }
                st.seen.insert(worker, Instant::now());
                ControlMsg::Map(st.job.job_map())
            }
            ControlMsg::GetSpec { rank } => {
                // A server registered before the first worker declared the
                // tensors waits for them (long poll).
                let mut st = locked();
                let deadline = Instant::now() + LONG_POLL;
                while !st.job.layout_fixed() {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    st = cv.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
                }
                ControlMsg::Registered { rank, spec_toml: st.job.spec_text().to_string() }
            }
            ControlMsg::Poll { rank, after } => {
                let mut st = locked();
                poller = Some(rank);
                st.dropped.remove(&rank);
                // It carried out the orders up to `after`: they are dropped.
                st.job.orders_polled(rank, after);
                let deadline = Instant::now() + LONG_POLL;
                // Alive while it waits here: its lease runs from the answer.
                st.polled.insert(rank, deadline);
                loop {
                    if st.job.lost_servers().contains(&rank) {
                        // Fenced off: its shards are served by their backups now.
                        poller = None;
                        break ControlMsg::Error {
                            message: format!(
                                "server {rank} was declared lost and its shards' backups serve them now; it must stop"
                            ),
                        };
                    }
                    let (last, orders) = st.job.orders_for(rank, after);
                    let left = deadline.saturating_duration_since(Instant::now());
                    if !orders.is_empty() || left.is_zero() {
                        st.polled.insert(rank, Instant::now());
                        break ControlMsg::Orders { last, orders };
                    }
                    st = cv.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
            ControlMsg::Status => {
                let st = locked();
                let mut text = st.job.status();
                if let Some((v, p)) = &st.last_checkpoint {
                    text += &format!("\ncheckpoint: iteration {v} in {}", p.display());
                }
                ControlMsg::StatusReport { text }
            }
            ControlMsg::Saved { version, start, len, file, sha256, missed, .. } => {
                let mut st = locked();
                let before = Path::new(&file).parent().and_then(Path::parent).map(|d| st.ckpt.outcome(d, version));
                let rec = st.job.checkpoint_record(version);
                let report = Report { version, start, len, file: &file, sha256: &sha256, missed };
                match st.ckpt.saved(&report, &rec) {
                    Outcome::Complete(p) if before != Some(Outcome::Complete(p.clone())) => {
                        eprintln!("eps control: checkpoint at iteration {version} complete in {}", p.display());
                        if st.last_checkpoint.as_ref().is_none_or(|(v, _)| *v < version) {
                            st.last_checkpoint = Some((version, p));
                        }
                    }
                    Outcome::Failed(why) if before == Some(Outcome::Pending) => {
                        eprintln!("eps control: the checkpoint at iteration {version} is abandoned: {why}");
                    }
                    _ => {}
                }
                cv.notify_all();
                ControlMsg::Ok
            }
            ControlMsg::Checkpoint { dir, .. } => checkpoint(locked(), cv, dir),
            _ => ControlMsg::Error { message: "unexpected message for the control plane".into() },
        };
        let sent = write_msg(&mut s, &reply);
        if finishes_job {
            locked().done_replied = true;
        }
        sent?;
    }
}

/// Tries this many versions, each further ahead, before an on-demand
/// checkpoint gives up.
const CHECKPOINT_TRIES: u32 = 10;
/// How long one try waits for the servers' pieces.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(120);

/// An operator's checkpoint: orders every server to save at a version no
/// worker has reached (as far as their last reports tell), waits for the
/// pieces, and tries further ahead when a server had passed it.
fn checkpoint(mut st: std::sync::MutexGuard<'_, State>, cv: &Condvar, dir: String) -> ControlMsg {
    let spec = JobSpec::from_toml(st.job.spec_text()).ok();
    let dir = if dir.is_empty() { spec.as_ref().and_then(|s| s.job.checkpoint_dir.clone()).unwrap_or_default() } else { dir };
    if dir.is_empty() {
        return ControlMsg::Error { message: "give a directory: the job's spec names no checkpoint_dir".into() };
    }
    if !Path::new(&dir).is_absolute() {
        return ControlMsg::Error { message: format!("{dir}: give an absolute directory (servers may run elsewhere)") };
    }
    if !st.job.initial_ready() {
        return ControlMsg::Error { message: crate::STILL_STARTING.into() };
    }
    let steps = spec.map_or(u64::MAX, |s| s.job.steps);
    let mut last = String::new();
    for attempt in 0..CHECKPOINT_TRIES {
        let version = st.job.furthest_iteration() + (8 << attempt);
        if version >= steps {
            return ControlMsg::Error {
                message: format!("the job ends (iteration {steps}) before a checkpoint could be taken{last}"),
            };
        }
        let rec = ControlMsg::Checkpoint { version, dir: dir.clone() };
        if let Err(message) = st.job.apply(&rec) {
            return ControlMsg::Error { message };
        }
        if let Err(e) = st.persist(&rec) {
            return ControlMsg::Error { message: format!("cannot persist the checkpoint order: {e}") };
        }
        cv.notify_all();
        let deadline = Instant::now() + CHECKPOINT_WAIT;
        loop {
            match st.ckpt.outcome(Path::new(&dir), version) {
                Outcome::Complete(p) => return ControlMsg::Checkpointed { version, path: p.display().to_string() },
                Outcome::Failed(why) => {
                    last = format!(" (last try: {why})");
                    break;
                }
                Outcome::Pending => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return ControlMsg::Error {
                    message: format!("the servers did not save iteration {version} within {} s", CHECKPOINT_WAIT.as_secs()),
                };
            }
            st = cv.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
    ControlMsg::Error { message: format!("no checkpoint after {CHECKPOINT_TRIES} tries{last}") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ControlClient;
    use crate::store::FileStore;
    use eps_proto::control::Role;

    const SPEC: &str = "[job]\nworkers = 1\nservers = 2\n[model]\npreset = \"synthetic\"\nbuckets = 1024\n";

    fn status(addr: SocketAddr, secret: &Secret) -> String {
        let mut c = ControlClient::connect(addr, secret, Duration::from_secs(5)).unwrap();
        match c.call(&ControlMsg::Status).unwrap() {
            ControlMsg::StatusReport { text } => text,
            m => panic!("{m:?}"),
        }
    }

    #[test]
    fn membership_survives_a_restart_and_the_job_is_bounded() {
        let dir = std::env::temp_dir().join(format!("eps-control-replay-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let spec = JobSpec::from_toml(SPEC).unwrap();
        let secret = Secret::new("replay").unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        {
            let svc = ControlService::bind(any, &spec, SPEC, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap();
            let addr = svc.local_addr();
            std::thread::spawn(move || svc.run());
            let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
            let r = c.call(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
            assert!(matches!(r, ControlMsg::Registered { rank: 0, .. }));
            let r = c.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
            assert!(matches!(r, ControlMsg::Registered { rank: 0, .. }));
            // Static membership: a second worker is refused with a reason.
            let e = c.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap_err();
            assert!(e.to_string().contains("already has its 1 workers"), "{e}");
            assert!(status(addr, &secret).contains("servers: 1/2 registered"));
        }
        // A new control plane on the same state directory replays the log.
        let svc = ControlService::bind(any, &spec, SPEC, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap();
        let addr = svc.local_addr();
        std::thread::spawn(move || svc.run());
        let text = status(addr, &secret);
        assert!(text.contains("servers: 1/2 registered") && text.contains("workers: 1/1 registered"), "{text}");
        let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
        let r = c.call(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        assert!(matches!(r, ControlMsg::Registered { rank: 1, .. }), "ranks continue after the replay");
        // Another job's spec cannot take over this state directory.
        let other = SPEC.replace("servers = 2", "servers = 3");
        let spec2 = JobSpec::from_toml(&other).unwrap();
        let e = ControlService::bind(any, &spec2, &other, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap_err();
        assert!(e.to_string().contains("another spec"), "{e}");
        // A wrong secret gets nothing.
        let bad = Secret::new("wrong").unwrap();
        assert!(ControlClient::connect(addr, &bad, Duration::from_secs(5)).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A server its peers cannot reach while it still polls (a cut link):
    /// lost once two peers say so; one peer alone, a repeated report, or the
    /// word of a server that was lost itself is not enough.
    #[test]
    fn a_server_two_peers_cannot_reach_is_lost_and_one_peer_is_not_enough() {
        let text = "[job]\nworkers = 2\nservers = 3\nreplicas = 2\n[model]\npreset = \"synthetic\"\nbuckets = 1024\n";
        let spec = JobSpec::from_toml(text).unwrap();
        let layout = spec.layout().unwrap();
        let dir = std::env::temp_dir().join(format!("eps-control-unreachable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let secret = Secret::new("unreachable").unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let svc = ControlService::bind(any, &spec, text, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap();
        let addr = svc.local_addr();
        std::thread::spawn(move || svc.run());
        let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
        let ep = |id: u32, r: u32| eps_proto::control::ShardEndpoint {
            shard: id,
            owner: r,
            landing: vec![(0, 0)],
            published_addr: 0,
            published_rkey: 0,
        };
        for r in 0..3u32 {
            c.call(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
            let shards = layout.shards_of(r).map(|s| ep(s.id, r)).collect();
            c.call(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
        }
        for _ in 0..2 {
            c.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
        }
        let lost = |r: u32| status(addr, &secret).contains(&format!("  server {r}: lost,"));
        let report = |c: &mut ControlClient, rank: u32, by: Role, by_rank: u32| {
            assert!(matches!(c.call(&ControlMsg::Unreachable { rank, by, by_rank }).unwrap(), ControlMsg::Ok));
        };
        // One worker, twice; and server 2 itself about server 1.
        report(&mut c, 2, Role::Worker, 0);
        report(&mut c, 2, Role::Worker, 0);
        report(&mut c, 1, Role::Server, 2);
        assert!(!lost(2) && !lost(1), "{}", status(addr, &secret));
        // A second peer: server 2 is lost, and its own report goes with it.
        report(&mut c, 2, Role::Worker, 1);
        assert!(lost(2), "{}", status(addr, &secret));
        report(&mut c, 1, Role::Worker, 0);
        assert!(!lost(1), "server 2's report still counted:\n{}", status(addr, &secret));
        // A lost server's word is void.
        report(&mut c, 0, Role::Server, 2);
        report(&mut c, 0, Role::Worker, 1);
        assert!(!lost(0), "{}", status(addr, &secret));
        std::fs::remove_dir_all(&dir).ok();
    }
}
