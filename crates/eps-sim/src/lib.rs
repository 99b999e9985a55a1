//! # eps-sim
//!
//! A seeded, deterministic simulation of an elastic job. The control plane is the
//! real one (`eps_control::job::Job`, sans-IO), and it crashes: a standby
//! replays its store and must lead the very same job (`failover.rs`). Servers
//! make their decisions through `eps-core`, as `eps-server` does: pushes,
//! pulls, parked updates, BSP completion, membership, both ends of a
//! migration, splits, replicas and sparse buckets; the workers use the same
//! protocol cores (`ShardSync`, `Membership`); messages travel on an
//! in-memory network with FIFO channels, random delays and a virtual clock
//! ([`net`]). A scale plan drawn from the seed adds and removes servers (shard
//! migrations) and workers (membership votes), and crashes workers (lease
//! expiry); balancing an added server splits shards. Parameters are stood in for
//! by a 64-bit digest per alignment unit (1,024 elements) and version, so values
//! and the reference do not depend on how shards are cut.
//!
//! After every delivery it checks that every version a live worker needs next is
//! servable by some server, that every server publishing a version of a shard
//! publishes the same value (a migration target tracks its source), and that an
//! aggregation consumes exactly its contributors' pushes of that iteration. At the
//! end it checks progress (every worker trained to the last step, left at a
//! boundary, or crashed) and that the final parameters equal a reference computed
//! from the committed contributor sets: no update lost or applied twice. A failure
//! names its seed; [`run`] with that seed replays it exactly.

#![forbid(unsafe_code)]

mod asynchronous;
mod checks;
mod failover;
pub mod net;
mod plan;
mod rollback;
mod server;
mod sparse;
mod worker;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use eps_control::job::Job;
use eps_proto::control::{ControlMsg, Role};
use eps_proto::membership::Membership;
use eps_proto::{Consistency, JobSpec};

use net::{Msg, Net, Node, Rng, h2, mix};
use server::SimServer;
use worker::{SimWorker, WState};

/// What happened in one run.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Deliveries processed.
    pub events: u64,
    /// Virtual time at the end.
    pub time: u64,
    /// Shard migrations completed.
    pub migrations: u64,
    /// Scale requests the control plane accepted (servers, workers).
    pub scales: (u64, u64),
    /// Workers crashed.
    pub crashes: u64,
    /// Worker membership changes committed.
    pub membership_changes: u64,
    /// Shard iterations aggregated without any contribution (every contributor
    /// was removed before pushing).
    pub empty_updates: u64,
    /// Shard splits.
    pub splits: u64,
    /// Servers crashed (jobs with replicas: their backups are promoted).
    pub server_crashes: u64,
    /// Runs with two replicas of every shard.
    pub replicated: u64,
    /// Runs by consistency: BSP, SSP, ASP.
    pub modes: [u64; 3],
    /// Roll-backs to a checkpoint after a server crash (jobs without replicas).
    pub rollbacks: u64,
    /// Workers that joined after the job started (a scale's new ranks).
    pub worker_joins: u64,
    /// Workers that left: removed by a scale-down, or crashed.
    pub worker_leaves: u64,
    /// Workers removed because their lease ran out.
    pub lease_expiries: u64,
    /// Backups promoted to owner after their owner was lost.
    pub promotions: u64,
    /// Control planes crashed and replaced by a standby replaying the store.
    pub control_failovers: u64,
    /// Runs with a sparse table.
    pub sparse_runs: u64,
    /// Bucket moves of a sparse table whose every row arrived.
    pub sparse_moves: u64,
}

impl Report {
    /// Adds `r`'s counts to these.
    pub fn add(&mut self, r: &Report) {
        self.events += r.events;
        self.time += r.time;
        self.migrations += r.migrations;
        self.scales.0 += r.scales.0;
        self.scales.1 += r.scales.1;
        self.crashes += r.crashes;
        self.membership_changes += r.membership_changes;
        self.empty_updates += r.empty_updates;
        self.splits += r.splits;
        self.server_crashes += r.server_crashes;
        self.replicated += r.replicated;
        for (m, n) in self.modes.iter_mut().zip(r.modes) {
            *m += n;
        }
        self.rollbacks += r.rollbacks;
        self.worker_joins += r.worker_joins;
        self.worker_leaves += r.worker_leaves;
        self.lease_expiries += r.lease_expiries;
        self.promotions += r.promotions;
        self.control_failovers += r.control_failovers;
        self.sparse_runs += r.sparse_runs;
        self.sparse_moves += r.sparse_moves;
    }
}

/// A run that broke an invariant or stopped making progress.
#[derive(Clone, Debug)]
pub struct Failure {
    /// The seed that replays it.
    pub seed: u64,
    /// Virtual time of the failure.
    pub time: u64,
    /// What went wrong.
    pub what: String,
    /// The last events before it.
    pub trace: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "seed {} failed at t={}: {}", self.seed, self.time, self.what)?;
        writeln!(f, "last events:")?;
        for l in &self.trace {
            writeln!(f, "  {l}")?;
        }
        write!(f, "replay: cargo run --release -p eps-sim -- --seed {}", self.seed)
    }
}

const STEPS_MAX: u64 = 40;
/// Elements per alignment unit (4 KiB of f32): values are kept per unit.
pub(crate) const UNIT: u64 = 1024;

/// The alignment units of `len` elements from `start`.
pub(crate) fn units(start: u64, len: u64) -> std::ops::Range<usize> {
    (start / UNIT) as usize..(start + len).div_ceil(UNIT) as usize
}
/// Lines of trace a failure shows.
const TRACE_LINES: usize = 300;
pub(crate) const LEASE: u64 = 400;
pub(crate) const TICK: u64 = 10;
const TIME_LIMIT: u64 = 2_000_000;

/// The simulated job's world.
pub(crate) struct World {
    rng: Rng,
    net: Net,
    pub(crate) job: Job,
    /// BSP, SSP or ASP, and SSP's staleness bound.
    pub(crate) mode: Consistency,
    pub(crate) staleness: u64,
    /// SSP/ASP: how many contributions of each worker every published
    /// (unit, version) holds, and the digest each worker pushed for (unit,
    /// iteration) (see `asynchronous.rs`).
    clocks: BTreeMap<(usize, u64), Vec<u64>>,
    pushed: BTreeMap<(u32, usize, u64), u64>,
    /// The job's sparse table, if it has one (see `sparse.rs`).
    pub(crate) sparse: Option<sparse::SparseWorld>,
    /// Servers the job started on.
    servers0: u32,
    /// Which servers take their orders late, if any (see `after_ctl`).
    slow: Option<u64>,
    /// The control plane's store: what a standby replays.
    store: failover::Store,
    pub(crate) steps: u64,
    /// Alignment units of the model.
    units: usize,
    ranks: u32,
    /// Workers at the start.
    workers0: u32,
    servers: Vec<Option<SimServer>>,
    /// Servers crashed (their slot in `servers` is empty).
    down: BTreeSet<u32>,
    replicas: u32,
    /// The job's first iteration (a roll-back's checkpoint).
    pub(crate) first: u64,
    ckpt: rollback::Checkpoints,
    /// Elements per shard in the spec.
    shard_units: u64,
    orders_after: Vec<u64>,
    workers: BTreeMap<u32, Option<SimWorker>>,
    /// Workers whose watcher still runs (they get maps and renew their lease).
    watching: BTreeSet<u32>,
    epoch_sent: u64,
    seen: BTreeMap<u32, u64>,
    /// First value published for (unit, version).
    published: BTreeMap<(usize, u64), u64>,
    /// Pushes a server took: (worker, unit, iteration).
    accepted: BTreeSet<(u32, usize, u64)>,
    /// Workers removed by lease expiry, with the commit's first iteration.
    pub(crate) lost: BTreeSet<(u32, u64)>,
    pub(crate) migrations: u64,
    pub(crate) empty_updates: u64,
    pub(crate) splits: u64,
    pub(crate) report: Report,
    plan_left: u32,
    /// The job's first workers have registered (later ones join it).
    started: bool,
    trace: VecDeque<String>,
    failure: Option<String>,
}

impl World {
    pub(crate) fn fail(&mut self, what: String) {
        if self.failure.is_none() {
            self.failure = Some(what);
        }
    }

    fn note(&mut self, line: String) {
        if self.trace.len() == TRACE_LINES {
            self.trace.pop_front();
        }
        self.trace.push_back(format!("t={} {line}", self.net.now));
    }

    /// Sends with a random delay; returns the delivery time.
    pub(crate) fn send(&mut self, from: Node, to: Node, msg: Msg) -> u64 {
        let d = self.rng.range(1, self.net.max_delay);
        self.net.send_after(from, to, msg, d);
        self.net.now + d
    }

    /// A completion at `node` some time after a delivery at `at`.
    pub(crate) fn complete_after(&mut self, node: Node, msg: Msg, at: u64) {
        let d = at.saturating_sub(self.net.now) + self.rng.range(1, self.net.max_delay);
        self.net.send_after(node, node, msg, d);
    }

    /// A timer for `node` in `lo..=hi`.
    pub(crate) fn timer(&mut self, node: Node, lo: u64, hi: u64) {
        let d = self.rng.range(lo, hi);
        self.net.send_after(node, node, Msg::Tick, d);
    }

    /// A control-plane call (the roles' calls are synchronous): applies it and
    /// delivers the orders and maps it caused.
    pub(crate) fn ctl(&mut self, m: &ControlMsg) -> Result<ControlMsg, eps_proto::control::Refusal> {
        let r = self.apply_recorded(m);
        if r.is_ok() {
            self.note(format!("control: {m:?}"));
        }
        self.after_ctl();
        r
    }

    /// A worker's watcher stopped (it finished, left or crashed).
    pub(crate) fn gone(&mut self, rank: u32) {
        self.watching.remove(&rank);
    }

    fn after_ctl(&mut self) {
        for r in 0..self.servers.len() {
            // (Delivery is reliable here: orders sent are carried out.)
            self.job.orders_polled(r as u32, self.orders_after[r]);
            let (last, orders) = self.job.orders_for(r as u32, self.orders_after[r]);
            self.orders_after[r] = last;
            if !orders.is_empty() {
                // A server takes its orders in between its other work: in
                // half the jobs, a third of the servers take them late (busy
                // with long updates), while a worker's map watch answers at
                // once.
                let d = self.rng.range(1, self.net.max_delay);
                let slow = self.slow.is_some_and(|s| mix(s ^ r as u64) % 3 == 0);
                let lag = if slow { self.rng.range(0, 4 * self.net.max_delay) } else { 0 };
                self.net.send_after(Node::Ctl, Node::Server(r as u32), Msg::Orders(orders), d + lag);
            }
        }
        if self.job.epoch() != self.epoch_sent {
            self.epoch_sent = self.job.epoch();
            let map = self.job.job_map();
            for r in self.watching.clone() {
                self.send(Node::Ctl, Node::Worker(r), Msg::Map(Box::new(map.clone())));
            }
        }
    }

    /// A server published `value` (per unit, from unit `first`) as version `v`
    /// of `shard`: for every unit, the same value as anyone else who published
    /// that version of it (under any shard id).
    pub(crate) fn publish(&mut self, server: u32, shard: u32, first: usize, v: u64, value: &[u64]) {
        for (u, &x) in (first..).zip(value) {
            match self.published.get(&(u, v)) {
                Some(&y) if y != x => {
                    return self.fail(format!(
                        "server {server} published version {v} of unit {u} (shard {shard}) as {x:x}, another server as {y:x}"
                    ));
                }
                Some(_) => {}
                None => {
                    self.published.insert((u, v), x);
                }
            }
        }
    }

    /// A server took worker `r`'s push of iteration `t` for these units.
    pub(crate) fn accept(&mut self, r: u32, units: std::ops::Range<usize>, t: u64) {
        for u in units {
            self.accepted.insert((r, u, t));
        }
    }

    /// A server gave back worker `r`'s push of iteration `t` ("moved").
    pub(crate) fn unaccept(&mut self, r: u32, units: std::ops::Range<usize>, t: u64) {
        for u in units {
            self.accepted.remove(&(r, u, t));
        }
    }

    /// The job's spec with `servers` servers.
    fn spec_text(&self, servers: u32) -> String {
        spec_text(
            self.workers0,
            servers,
            self.steps,
            self.ranks,
            self.replicas,
            self.mode,
            self.staleness,
            self.shard_units,
            self.units,
            self.sparse.is_some(),
        )
    }

    /// The keys worker `r` looks up in iteration `t` (none without a table).
    pub(crate) fn sparse_keys(&self, r: u32, t: u64) -> Vec<u64> {
        self.sparse.as_ref().map_or(Vec::new(), |s| s.keys(r, t))
    }

    fn start_server(&mut self, shards: &[(u32, u64, u64)], backups: &[(u32, u64, u64, u32)]) {
        let init: Vec<u64> = (0..self.units).map(init_value).collect();
        self.start_server_at(0, &init, shards, backups);
    }

    /// Starts a server holding `shards` and `backups` at version `at`, of
    /// value `values` (per unit).
    fn start_server_at(&mut self, at: u64, values: &[u64], shards: &[(u32, u64, u64)], backups: &[(u32, u64, u64, u32)]) {
        let reg = self.apply_recorded(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() });
        let Ok(ControlMsg::Registered { rank, .. }) = reg else { return };
        let mut s = SimServer::new(rank, self.mode, self.ranks, self.workers0, at, shards, backups, |u| values[u]);
        if self.replicas > 1 {
            s.await_backups();
        }
        self.servers.push(None);
        self.orders_after.push(0);
        if self.sparse.is_some() {
            s.table = Some(server::SimTable::new(self.mode, self.ranks, self.servers0));
            let tables = vec![server::table_endpoint(rank, self.ranks)];
            if let Err(e) = self.ctl(&ControlMsg::TablesReady { rank, tables }) {
                self.fail(format!("server {rank}: its table's part was refused: {e}"));
            }
        }
        let eps = shards.iter().map(|&(id, _, _)| server::endpoint(id, rank)).collect();
        if let Err(e) = self.ctl(&ControlMsg::ServerReady { rank, fabric_addr: format!("sim:{rank}"), shards: eps }) {
            self.fail(format!("server {rank} ready refused: {e}"));
        }
        s.report_backups(self);
        self.servers[rank as usize] = Some(s);
        self.note(format!("server {rank} started with shards {shards:?}, backups {backups:?}"));
    }

    fn start_worker(&mut self) {
        let reg = self.apply_recorded(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() });
        let Ok(ControlMsg::Registered { rank, .. }) = reg else { return };
        self.note(format!("worker {rank} registered"));
        self.seen.insert(rank, self.net.now);
        self.watching.insert(rank);
        if self.started {
            self.report.worker_joins += 1;
        }
        let mut w = SimWorker::new(rank, self.job.job_map(), self.units);
        w.replicated = self.replicas > 1;
        if self.sparse.is_some() {
            w.table = Some(worker::WTable::new(self.servers0));
        }
        w.try_admit(self);
        self.workers.insert(rank, Some(w));
    }

    fn deliver(&mut self, from: Node, to: Node, msg: Msg) {
        match to {
            Node::Server(r) => {
                let Some(mut s) = self.servers.get_mut(r as usize).and_then(Option::take) else { return };
                s.handle(self, from, msg);
                self.servers[r as usize] = Some(s);
            }
            Node::Worker(r) => {
                let Some(mut w) = self.workers.get_mut(&r).and_then(Option::take) else { return };
                w.handle(self, from, msg);
                self.workers.insert(r, Some(w));
            }
            Node::Ctl => match msg {
                Msg::Tick => self.lease_tick(),
                Msg::Plan => self.plan_step(),
                // `eps control`: its lease lapsed (or its poll dropped).
                Msg::Lost { s } => match self.job.server_gone(s) {
                    None => self.note(format!("server {s}'s loss changes nothing")),
                    Some(m) => {
                        self.note(format!("server {s} declared lost"));
                        if let Err(e) = self.ctl(&m) {
                            self.fail(format!("declaring server {s} lost: {e}"));
                        }
                    }
                },
                m => self.fail(format!("control got {m:?} from {from:?}")),
            },
        }
    }

    /// Whether server `rank` crashed.
    pub(crate) fn crashed(&self, rank: u32) -> bool {
        self.down.contains(&rank)
    }

    /// Pushes of `shard` to server `rank` in flight.
    pub(crate) fn pushes_in_flight(&self, rank: u32, shard: u32) -> usize {
        self.net.pushes_to(rank, shard)
    }
}

/// A simulated job's spec.
#[allow(clippy::too_many_arguments)]
fn spec_text(
    workers: u32,
    servers: u32,
    steps: u64,
    max_workers: u32,
    replicas: u32,
    mode: Consistency,
    staleness: u64,
    shard_units: u64,
    units: usize,
    table: bool,
) -> String {
    let table = if table { "[[model.tables]]\nname = \"emb\"\ndim = 4\n" } else { "" };
    let staleness = if mode == Consistency::Ssp { format!("staleness = {staleness}\n") } else { String::new() };
    format!(
        "[job]\nworkers = {workers}\nservers = {servers}\nsteps = {steps}\nmax_workers = {max_workers}\nreplicas = {replicas}\n\
         shard_bytes = {}\nconsistency = \"{}\"\n{staleness}[model]\ntensors = [{{ name = \"w\", elements = {} }}]\n{table}",
        shard_units * 4 * UNIT,
        mode.name(),
        units as u64 * UNIT
    )
}

/// Version 0 of a unit.
fn init_value(unit: usize) -> u64 {
    mix(0xE95 ^ unit as u64)
}

/// Worker `r`'s gradient digest for unit `u` in iteration `t`, computed from the
/// unit's value `value` (of version `t`).
pub(crate) fn token(r: u32, t: u64, u: usize, value: u64) -> u64 {
    h2(h2(u64::from(r), t), h2(u as u64, value))
}

/// Runs the simulation for `seed`.
pub fn run(seed: u64) -> Result<Report, Failure> {
    let mut rng = Rng::new(seed);
    let units = rng.range(1, 8);
    // Shards of one to four units: adding a server splits some.
    let shard_units = rng.range(1, 4);
    // A third of the jobs keep a backup of every shard; their servers crash.
    let replicas = if rng.range(0, 2) == 0 { 2 } else { 1 };
    let servers = if replicas > 1 { rng.range(2, 4) } else { rng.range(1, 3) } as u32;
    let workers = rng.range(1, 3) as u32;
    let steps = rng.range(12, STEPS_MAX);
    // Of the jobs without replicas, a third are SSP and a third ASP (drawn
    // aside, so that a BSP seed runs as it did before they were simulated).
    let mut aside = Rng::new(seed ^ 0xA5F1_C0DE);
    let (mode, staleness) = match (replicas, aside.range(0, 2)) {
        (1, 0) => (Consistency::Ssp, aside.range(1, 3)),
        (1, 1) => (Consistency::Asp, 0),
        _ => (Consistency::Bsp, 0),
    };
    // Half the jobs without replicas have a sparse table (tables have no
    // backups yet).
    let table = replicas == 1 && aside.range(0, 1) == 0;
    // (Workers join a running job under BSP only.)
    let max_workers = if mode == Consistency::Bsp { workers + 4 } else { workers };
    let text = spec_text(workers, servers, steps, max_workers, replicas, mode, staleness, shard_units, units as usize, table);
    // Checkpoints every few versions.
    let every = rng.range(2, 6);
    let spec = JobSpec::from_toml(&text).map_err(|e| fail_at(seed, 0, format!("spec: {e}")))?;
    let layout = spec.layout().map_err(|e| fail_at(seed, 0, format!("layout: {e}")))?;
    let job = Job::new(&spec, &text).map_err(|e| fail_at(seed, 0, format!("job: {e}")))?;
    let max_delay = rng.range(2, 30);
    let mut w = World {
        rng,
        net: Net::new(max_delay),
        job,
        mode,
        staleness,
        clocks: BTreeMap::new(),
        pushed: BTreeMap::new(),
        sparse: table.then(|| sparse::SparseWorld::new(aside.next_u64())),
        servers0: servers,
        slow: (aside.range(0, 1) == 0).then(|| aside.next_u64()),
        store: failover::Store { spec_text: text.clone(), records: Vec::new() },
        steps,
        units: units as usize,
        ranks: max_workers,
        workers0: workers,
        servers: Vec::new(),
        down: BTreeSet::new(),
        replicas,
        first: 0,
        ckpt: rollback::Checkpoints::every(every),
        shard_units,
        orders_after: Vec::new(),
        workers: BTreeMap::new(),
        watching: BTreeSet::new(),
        epoch_sent: 0,
        seen: BTreeMap::new(),
        published: BTreeMap::new(),
        accepted: BTreeSet::new(),
        lost: BTreeSet::new(),
        migrations: 0,
        empty_updates: 0,
        splits: 0,
        report: Report::default(),
        plan_left: 10,
        started: false,
        trace: VecDeque::new(),
        failure: None,
    };
    for r in 0..servers {
        let mine: Vec<(u32, u64, u64)> = layout.shards_of(r).map(|s| (s.id, s.start, s.len)).collect();
        let backups: Vec<(u32, u64, u64, u32)> =
            if replicas > 1 { layout.backups_of(r).map(|s| (s.id, s.start, s.len, s.server)).collect() } else { Vec::new() };
        w.start_server(&mine, &backups);
    }
    for u in 0..w.units {
        w.published.insert((u, 0), init_value(u));
    }
    for _ in 0..workers {
        w.start_worker();
    }
    w.started = true;
    w.net.send_after(Node::Ctl, Node::Ctl, Msg::Tick, TICK);
    let first = w.rng.range(5, 100);
    w.net.send_after(Node::Ctl, Node::Ctl, Msg::Plan, first);
    let mut last_progress = 0;
    while let Some((from, to, msg)) = w.net.pop() {
        w.report.events += 1;
        if !matches!((&msg, to), (Msg::Tick, Node::Ctl) | (Msg::Plan, _)) {
            last_progress = w.net.now;
            let line = format!("{from:?} -> {to:?}: {msg:?}");
            w.note(line);
        }
        w.deliver(from, to, msg);
        if w.failure.is_none() && mode == Consistency::Bsp {
            w.check_servable();
        }
        if w.failure.is_none() && (w.net.now > TIME_LIMIT || w.net.now - last_progress > 20 * LEASE) {
            let what = format!("no progress since t={last_progress}:\n{}", w.dump());
            w.fail(what);
        }
        if w.failure.is_some() {
            break;
        }
    }
    if w.failure.is_none() {
        if mode == Consistency::Bsp { w.check_end() } else { w.check_end_async() }
    }
    if w.failure.is_none() {
        w.check_pieces();
    }
    if w.failure.is_none() && !w.job.done() {
        // `eps control` ends once every worker and server finished or was
        // lost; one that would wait forever hangs whatever launched the job.
        let what = format!("the run is over but its control plane would not end:\n{}", w.dump());
        w.fail(what);
    }
    if let Some(what) = w.failure.take() {
        return Err(Failure { seed, time: w.net.now, what, trace: w.trace.into_iter().collect() });
    }
    w.report.time = w.net.now;
    w.report.migrations = w.migrations;
    w.report.empty_updates = w.empty_updates;
    w.report.splits = w.splits;
    w.report.replicated = u64::from(replicas > 1);
    w.report.modes[mode as usize] = 1;
    w.report.sparse_runs = u64::from(table);
    w.report.sparse_moves = w.sparse.as_ref().map_or(0, |s| s.moves);
    Ok(w.report)
}

/// The first of `seeds` that fails with mutant `name` on (a known bug put
/// back, see `eps_proto::mutants`), or `None` if every one keeps the
/// invariants. The mutant is off again on return.
#[cfg(feature = "mutants")]
pub fn first_caught(name: &str, seeds: std::ops::Range<u64>) -> Result<Option<Failure>, String> {
    eps_proto::mutants::set(Some(name))?;
    let caught = seeds.into_iter().find_map(|s| run(s).err());
    eps_proto::mutants::set(None)?;
    Ok(caught)
}

fn fail_at(seed: u64, time: u64, what: String) -> Failure {
    Failure { seed, time, what, trace: Vec::new() }
}
