//! The control-plane service: assigns ranks, hands out the spec, and serves the job
//! state of [`crate::job::Job`]: the shard map to workers (long polls that answer
//! when the epoch moves), orders to servers (long polls too), scale requests, and
//! the reports of migrations. Every state change is persisted before it is
//! acknowledged.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use eps_fabric::Secret;
use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, Role};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::ControlError;
use crate::checkpoint::Tracker;
use crate::job::Job;
use crate::store::Store;

mod event;
mod health;
mod metrics;
mod requests;

use event::Conn;

/// How often leases are checked (and waiting answers tried again).
const TICK: Duration = Duration::from_millis(20);

/// Marks the spec record in the store.
const SPEC_RECORD_RANK: u32 = u32::MAX;

/// How often the job's figures go to the metrics.
const PUBLISH: Duration = Duration::from_millis(250);

/// How long a server's dropped order poll may stay away before it is lost.
const SERVER_GRACE: Duration = Duration::from_millis(1500);

/// Reports that a server is unreachable count together within this.
const UNREACHABLE_WINDOW: Duration = Duration::from_secs(30);

/// How long a long poll (map or orders) waits for news before answering anyway.
const LONG_POLL: Duration = Duration::from_millis(500);
/// Connections that have not proved the job secret yet, at most (each has
/// `event::AUTH_TIME` to do so): more than a job's peers ever open at once.
const MAX_UNPROVEN: usize = 256;

struct State {
    job: Job,
    /// When each worker rank last reached the control plane (its lease).
    seen: HashMap<u32, Instant>,
    lease: Duration,
    /// When each rank a scale admitted was first seen waiting to register.
    awaiting: HashMap<u32, Instant>,
    join_deadline: Duration,
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
    /// Servers gone when their loss changed nothing (a job without
    /// replicas, a server holding nothing): declared once it does (told to
    /// retire as the job ends, such a server is counted finished), unless
    /// they poll again.
    gone_idle: Vec<u32>,
    /// Servers reported unreachable (a data connection cut while they poll):
    /// who reported each, and when first.
    unreachable: HashMap<u32, (Vec<(Role, u32)>, Instant)>,
    server_lease: Duration,
    /// Its series of the process's metrics.
    metrics: metrics::Metrics,
    /// The job's name, this control plane's address, and the furthest
    /// iteration over the last seconds (for `eps status`).
    name: String,
    addr: SocketAddr,
    rate: health::Rate,
    /// Why the store refused a record, if it did: the state in memory is
    /// ahead of the store's, so the service stops (a restart or a standby
    /// replays the store).
    broken: Option<String>,
}

impl State {
    fn persist(&mut self, m: &ControlMsg) -> Result<(), ControlError> {
        self.store.append(&m.encode()[4..]).map_err(|e| {
            self.broken.get_or_insert_with(|| e.to_string());
            ControlError::Store(e)
        })
    }

    /// Declares lost the servers whose order poll dropped and did not come
    /// back within `SERVER_GRACE`, or stopped coming for the server lease
    /// (a job with replicas promotes their backups).
    fn lose_servers(&mut self) -> Result<(), ControlError> {
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
        for (r, why) in gone {
            self.dropped.remove(&r);
            self.polled.remove(&r);
            self.declare_lost(r, &why)?;
        }
        for r in self.gone_idle.clone() {
            if self.job.server_gone(r).is_some() {
                self.gone_idle.retain(|&x| x != r);
                self.declare_lost(r, "it was gone already")?;
            }
        }
        Ok(())
    }

    /// Declares server `rank` lost (`why`), in a job with replicas that it
    /// still serves: its backups take over (a record of the store).
    fn declare_lost(&mut self, rank: u32, why: &str) -> Result<(), ControlError> {
        let retiring = self.job.server_retiring(rank);
        let Some(m) = self.job.server_gone(rank) else {
            if !self.gone_idle.contains(&rank) {
                eps_proto::say!("eps control: server {rank} is gone ({why}); its loss changes nothing now");
                self.gone_idle.push(rank);
            }
            return Ok(());
        };
        let was_done = self.job.done();
        if self.job.apply(&m).is_err() {
            return Ok(());
        }
        self.ended_unasked(was_done);
        self.forget_reports_of(rank);
        if retiring {
            eps_proto::say!(
                "eps control: server {rank} was told to retire and is gone ({why}) before it said it finished; counted as finished"
            );
        } else {
            eps_proto::say_event!(
                "server_lost",
                { job = self.name.as_str(), server = rank, why = why },
                "eps control: server {rank} is lost ({why}); its shards' backups take over"
            );
        }
        self.persist(&m)
    }

    /// Peer `by` cannot reach server `rank`. Two peers saying so (or a job's
    /// only worker) make it lost, in a job with replicas: its backups take
    /// over and it is fenced off. One peer alone may be the broken end: it
    /// gives up on its own (a worker leaves the job).
    fn unreachable(&mut self, rank: u32, by: (Role, u32)) -> Result<(), ControlError> {
        let now = Instant::now();
        self.unreachable.retain(|_, (_, first)| now.duration_since(*first) < UNREACHABLE_WINDOW);
        if !self.job.replicated() || !self.job.server_serving(rank) || self.job.done() || by == (Role::Server, rank) {
            return Ok(()); // (nothing to declare: see `declare_lost`)
        }
        if by.0 == Role::Server && !self.job.server_serving(by.1) {
            // A lost server's connections fail as it goes: its word is void.
            return Ok(());
        }
        let (who, _) = self.unreachable.entry(rank).or_insert_with(|| (Vec::new(), now));
        if !who.contains(&by) {
            who.push(by);
        }
        let alone = by.0 == Role::Worker && self.job.leased_workers().len() == 1;
        if who.len() < 2 && !alone {
            eps_proto::say!("eps control: {:?} {} cannot reach server {rank} (one report: not declared lost yet)", by.0, by.1);
            return Ok(());
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
    /// request, which its watcher thread makes at least every long poll), and
    /// ranks a scale admitted that did not register within the join deadline.
    fn expire_leases(&mut self) -> Result<(), ControlError> {
        let now = Instant::now();
        let awaited = self.job.awaited_workers();
        self.awaiting.retain(|r, _| awaited.contains(r));
        for r in awaited {
            let since = *self.awaiting.entry(r).or_insert(now);
            if now.duration_since(since) > self.join_deadline {
                let ms = now.duration_since(since).as_millis() as u64;
                let why = format!(
                    "worker rank {r} was admitted {ms} ms ago and no worker registered for it (job.join_deadline_ms); removing it at the next iteration boundary"
                );
                self.expire(r, ms, &why)?;
            }
        }
        for r in self.job.leased_workers() {
            let seen = *self.seen.entry(r).or_insert(now);
            if now.duration_since(seen) > self.lease {
                let ms = now.duration_since(seen).as_millis() as u64;
                let why = format!("worker {r} has not renewed its lease for {ms} ms; removing it at the next iteration boundary");
                self.expire(r, ms, &why)?;
            }
        }
        Ok(())
    }

    /// The job was not over (`was_done`) and a change the service made on
    /// its own (a lease, a server gone) ended it: no request waits for an
    /// answer, so the service may exit. (It would otherwise wait for the
    /// reply to a `Finished` that never comes: a job whose last server died
    /// as it retired never ended.)
    fn ended_unasked(&mut self, was_done: bool) {
        if !was_done && self.job.done() {
            self.done_replied = true;
        }
    }

    fn expire(&mut self, r: u32, ms: u64, why: &str) -> Result<(), ControlError> {
        let m = ControlMsg::Expire { rank: r };
        let was_done = self.job.done();
        if self.job.apply(&m).is_ok() {
            self.ended_unasked(was_done);
            eps_proto::say_event!(
                "worker_expired",
                { job = self.name.as_str(), worker = r, silent_ms = ms },
                "eps control: {why}"
            );
            self.persist(&m)?;
        }
        Ok(())
    }
}

/// A running control plane.
pub struct ControlService {
    listener: TcpListener,
    secret: Secret,
    st: State,
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
        Self::on(listener, spec, spec_text, secret, store)
    }

    /// As [`ControlService::bind`], on a listener already bound (a standby's
    /// that takes over).
    pub fn on(
        listener: TcpListener,
        spec: &JobSpec,
        spec_text: &str,
        secret: Secret,
        store: Box<dyn Store>,
    ) -> Result<Self, ControlError> {
        let addr = listener.local_addr().map_err(ControlError::Io)?;
        let spec_record = ControlMsg::Registered { rank: SPEC_RECORD_RANK, spec_toml: spec_text.to_string() };
        let job = Job::new(spec, spec_text).map_err(|_| ControlError::Protocol("the job spec has no valid layout"))?;
        let lease = Duration::from_millis(spec.job.worker_lease_ms);
        let ckpt = Tracker::new(spec.job.checkpoint_keep);
        let mut st = State {
            job,
            seen: HashMap::new(),
            lease,
            awaiting: HashMap::new(),
            join_deadline: Duration::from_millis(spec.job.join_deadline_ms),
            gone_idle: Vec::new(),
            done_replied: false,
            store,
            ckpt,
            last_checkpoint: None,
            dropped: HashMap::new(),
            polled: HashMap::new(),
            unreachable: HashMap::new(),
            server_lease: Duration::from_millis(spec.job.server_lease_ms),
            metrics: metrics::Metrics::new(&spec.job.name),
            name: spec.job.name.clone(),
            addr: listener.local_addr().map_err(|e| ControlError::Bind { addr, source: e })?,
            rate: health::Rate::default(),
            broken: None,
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
        Ok(Self { listener, secret, st })
    }

    /// The job's figures as replayed (or served so far).
    pub fn figures(&self) -> crate::job::Figures {
        self.st.job.figures()
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
    /// shutting down an embedded job). One thread serves every connection:
    /// the control plane's memory does not grow with how many peers came and
    /// went, or with how many were connected at once.
    pub fn run_until(mut self, stop: &AtomicBool) -> Result<(), ControlError> {
        self.listener.set_nonblocking(true).map_err(ControlError::Io)?;
        let mut conns: Vec<Conn> = Vec::new();
        let mut tick = Instant::now();
        let mut published = tick - PUBLISH;
        loop {
            if stop.load(Ordering::Acquire) || self.st.done_replied {
                return Ok(());
            }
            if let Some(why) = self.st.broken.take() {
                return Err(ControlError::Store(std::io::Error::other(why)));
            }
            let now = Instant::now();
            // The job changes with requests and with leases: waiting answers
            // are tried again after either, and when their deadline passes.
            let mut changed = false;
            if now >= tick {
                tick = now + TICK;
                self.st.expire_leases()?;
                self.st.lose_servers()?;
                if now.duration_since(published) >= PUBLISH {
                    published = now;
                    let f = self.st.job.figures();
                    self.st.metrics.publish(&f);
                    self.st.rate.sample(now, f.iteration);
                }
                changed = true;
            }
            let next = conns.iter().filter_map(Conn::deadline).fold(tick, Instant::min);
            let mut timeout = next.saturating_duration_since(Instant::now()).as_millis().min(TICK.as_millis()) as u16;
            if conns.iter().any(Conn::pending) {
                // Requests left from a connection's last turn: no sleep.
                timeout = 0;
            }
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(conns.len() + 1);
            fds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
            for c in &conns {
                let out = if c.writing() { PollFlags::POLLOUT } else { PollFlags::empty() };
                let inp = if c.reading() { PollFlags::POLLIN } else { PollFlags::empty() };
                fds.push(PollFd::new(c.s.as_fd(), inp | out));
            }
            match poll(&mut fds, PollTimeout::from(timeout)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(ControlError::Io(e.into())),
            }
            let ready: Vec<PollFlags> = fds.iter().map(|f| f.revents().unwrap_or(PollFlags::empty())).collect();
            drop(fds);
            for (c, r) in conns.iter_mut().zip(&ready[1..]) {
                if r.intersects(PollFlags::POLLOUT) {
                    c.writable(&mut self.st, &self.secret);
                }
                if r.intersects(PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR) {
                    c.readable(&mut self.st, &self.secret, r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR));
                    changed = true;
                }
            }
            if ready[0].intersects(PollFlags::POLLIN) {
                self.accept(&mut conns)?;
            }
            for c in conns.iter_mut().filter(|c| c.pending()) {
                c.advance(&mut self.st, &self.secret);
                changed = true;
            }
            let now = Instant::now();
            for c in conns.iter_mut() {
                if changed || c.deadline().is_some_and(|d| now >= d) {
                    c.retry(&mut self.st, &self.secret);
                    c.expire(&mut self.st, now);
                }
            }
            conns.retain(|c| !c.dead);
        }
    }

    /// Takes the connections waiting to be accepted.
    fn accept(&mut self, conns: &mut Vec<Conn>) -> Result<(), ControlError> {
        loop {
            match self.listener.accept() {
                // (A socket that cannot be set up is dropped: its peer retries.)
                Ok((s, _)) => {
                    conns.extend(Conn::new(s).ok());
                    // Past the bound, the oldest connection still to prove
                    // the secret goes: what peers without it hold is bounded.
                    if conns.iter().filter(|c| !c.proven() && !c.dead).count() > MAX_UNPROVEN
                        && let Some(old) = conns.iter_mut().find(|c| !c.proven() && !c.dead)
                    {
                        old.drop_unproven();
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted) => {}
                // Out of descriptors, say: the peers wait and retry.
                Err(e) if e.raw_os_error().is_some_and(|c| c == 24 || c == 23) => return Ok(()),
                Err(e) => return Err(ControlError::Io(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests;
