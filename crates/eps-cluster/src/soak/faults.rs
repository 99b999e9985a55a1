//! The soak's fault thread: every few seconds, once the job is settled and
//! every shard has a backup, it kills a server (and starts its replacement),
//! cuts every data connection to a server that lives on (`ss -K`: its peers
//! report it unreachable, the control plane declares it lost and fences it
//! off, and a replacement starts), scales the servers out or in, stops a
//! server or a worker for less than its lease, or kills the control plane;
//! then it waits for the job to recover.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eps_control::ControlClient;
use eps_fabric::Secret;
use eps_proto::control::ControlMsg;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

use crate::cluster::Processes;
use crate::scale::Spawn;

/// What the thread did to the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// SIGKILL of a server; a replacement is started.
    ServerKill,
    /// One server more.
    ScaleOut,
    /// One server less.
    ScaleIn,
    /// SIGSTOP of a server for less than its lease, then SIGCONT.
    ServerStall,
    /// SIGSTOP of a worker for less than its lease, then SIGCONT.
    WorkerStall,
    /// SIGKILL of the control plane (the cluster restarts it from its store).
    ControlKill,
    /// Every data connection to a live server cut (`ss -K`, root only); a
    /// replacement is started once it is declared lost.
    ServerCut,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::ServerKill,
        Kind::ScaleOut,
        Kind::ScaleIn,
        Kind::ServerStall,
        Kind::WorkerStall,
        Kind::ControlKill,
        Kind::ServerCut,
    ];

    /// By its [`Kind::name`].
    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::ServerKill => "server_kill",
            Kind::ScaleOut => "scale_out",
            Kind::ScaleIn => "scale_in",
            Kind::ServerStall => "server_stall",
            Kind::WorkerStall => "worker_stall",
            Kind::ControlKill => "control_kill",
            Kind::ServerCut => "server_cut",
        }
    }
}

/// One fault and how the job came back from it.
#[derive(Clone, Debug)]
pub struct Fault {
    pub kind: Kind,
    /// Seconds since the soak started.
    pub at_s: f64,
    /// Rank 0's step then.
    pub step: u64,
    /// What was hit (`server 2 (pid 123)`, `4 -> 5 servers`).
    pub what: String,
    /// Seconds from the fault to the job settled again (None: it did not).
    pub recovered_s: Option<f64>,
}

/// What the fault thread shares with the soak.
#[derive(Debug, Default)]
pub struct Log {
    pub faults: Vec<Fault>,
    /// Faults the job did not recover from, and other failures.
    pub errors: Vec<String>,
    /// Seconds since the start when the last fault was over and the servers
    /// were back to their number at the start (None: training ended first).
    pub quiet_from: Option<f64>,
}

/// Where the thread works and when.
pub struct Plan {
    pub control: SocketAddr,
    pub secret: Secret,
    pub procs: Processes,
    pub spawn: Sender<Spawn>,
    /// Rank 0's finished steps.
    pub step: Arc<AtomicU64>,
    /// Faults are injected from this step...
    pub first: u64,
    /// ...until this one; then the servers go back to `servers`.
    pub last: u64,
    pub servers: u32,
    /// The kinds of fault to inject.
    pub kinds: Vec<Kind>,
    /// Mean time between faults.
    pub every: Duration,
    pub seed: u64,
    pub t0: Instant,
    /// Set when training ended: the thread returns.
    pub done: Arc<AtomicBool>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan").field("control", &self.control).field("first", &self.first).field("last", &self.last).finish()
    }
}

/// Whether connections can be cut here: `ss -K` (iproute2) needs root and a
/// kernel with socket destruction.
pub fn can_cut() -> bool {
    // (The effective uid is the second of /proc/self/status's `Uid:` line.)
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().nth(1));
    euid == Some("0") && std::process::Command::new("ss").arg("-V").output().is_ok_and(|o| o.status.success())
}

/// The fabric port of server `rank`, from the status's server lines
/// (`  server 2: serving, 4 shards, 1024 bytes, 127.0.0.1:40123 [shards ...]`).
fn server_port(status: &Value, rank: u32) -> Option<u16> {
    let addr = server(status, rank)?.get("addr")?.as_str()?;
    addr.parse::<SocketAddr>().ok().map(|a| a.port())
}

/// Server `rank`'s row of a `StatusJson` answer.
fn server(status: &Value, rank: u32) -> Option<&Value> {
    status.get("servers")?.as_array()?.iter().find(|s| s.get("rank").and_then(Value::as_u64) == Some(rank.into()))
}

/// Whether server `rank` was declared lost.
fn lost(status: &Value, rank: u32) -> bool {
    server(status, rank).and_then(|s| s.get("state")?.as_str()) == Some("lost")
}

/// Cuts every established TCP connection to or from `port` on this host (both
/// ends see it fail at once); returns how many.
pub fn cut_port(port: u16) -> Result<usize, String> {
    let filter = format!("( sport = :{port} or dport = :{port} )");
    let o = std::process::Command::new("ss")
        .args(["-K", "-t", "-n", "-H", "state", "established"])
        .arg(&filter)
        .output()
        .map_err(|e| format!("ss -K: {e}"))?;
    if !o.status.success() {
        return Err(format!("ss -K {filter}: {}", String::from_utf8_lossy(&o.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&o.stdout).lines().filter(|l| !l.trim().is_empty()).count())
}

/// A server must be declared lost, and a job settle, within these.
const LOST_WITHIN: Duration = Duration::from_secs(30);
const SETTLE_WITHIN: Duration = Duration::from_secs(120);
/// Control-plane kills in one soak: the cluster restarts it at most 3 times.
const CONTROL_KILLS: u32 = 2;

/// Runs the thread; faults and errors go to `log`.
pub fn spawn(plan: Plan, log: Arc<Mutex<Log>>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut t = Thread { ctl: None, plan, log, rng: 0, live: 0, control_kills: 0 };
        t.rng = t.plan.seed ^ 0x50AC_0000_0000_0001;
        t.live = t.plan.servers;
        if let Err(e) = t.run() {
            t.log().errors.push(e);
        }
    })
}

struct Thread {
    ctl: Option<ControlClient>,
    plan: Plan,
    log: Arc<Mutex<Log>>,
    rng: u64,
    /// Servers the job is asked to have now.
    live: u32,
    control_kills: u32,
}

impl Thread {
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn step(&self) -> u64 {
        self.plan.step.load(Ordering::Acquire)
    }

    fn over(&self) -> bool {
        self.plan.done.load(Ordering::Acquire)
    }

    /// Sleeps `d`, or less if training ends.
    fn sleep(&self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until && !self.over() {
            std::thread::sleep(Duration::from_millis(20).min(until.saturating_duration_since(Instant::now())));
        }
    }

    fn run(&mut self) -> Result<(), String> {
        while self.step() < self.plan.first {
            if self.over() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        while self.step() < self.plan.last && !self.over() {
            let every = self.plan.every.as_secs_f64();
            let gap = self.uniform(0.5 * every, 1.5 * every);
            self.sleep(Duration::from_secs_f64(gap));
            if self.over() || self.step() >= self.plan.last {
                break;
            }
            self.settled(SETTLE_WITHIN)?;
            let kind = self.choose();
            let (at, step, started) = (self.plan.t0.elapsed().as_secs_f64(), self.step(), Instant::now());
            let what = self.inject(kind)?;
            eps_proto::say!("eps soak: [{at:>6.1} s] step {step}: {} ({what})", kind.name());
            let recovered = self.recover(kind);
            let recovered_s = recovered.as_ref().ok().map(|_| started.elapsed().as_secs_f64());
            if let Some(s) = recovered_s {
                eps_proto::say!("eps soak: recovered from {} in {s:.1} s", kind.name());
            }
            self.log().faults.push(Fault { kind, at_s: at, step, what, recovered_s });
            recovered?;
        }
        // The end of the run has the servers it started with (RSS compares
        // like with like).
        if self.live != self.plan.servers && !self.over() {
            self.settled(SETTLE_WITHIN)?;
            self.scale_to(self.plan.servers)?;
            self.settled(SETTLE_WITHIN)?;
        }
        if !self.over() {
            self.log().quiet_from = Some(self.plan.t0.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// A fault the job can take now: a server killed leaves two at least, a
    /// scale stays within one of the start (a stall when none can).
    fn choose(&mut self) -> Kind {
        for _ in 0..1000 {
            let i = self.next() % self.plan.kinds.len() as u64;
            let k = self.plan.kinds[i as usize];
            let ok = match k {
                Kind::ServerKill | Kind::ScaleIn => self.live >= 3 && self.live + 1 >= self.plan.servers,
                Kind::ServerCut => self.live >= 3 && self.live + 1 >= self.plan.servers && can_cut(),
                Kind::ScaleOut => self.live <= self.plan.servers,
                Kind::ControlKill => self.control_kills < CONTROL_KILLS,
                Kind::ServerStall | Kind::WorkerStall => true,
            };
            if ok {
                return k;
            }
        }
        Kind::WorkerStall
    }

    /// A running process whose name starts with `prefix`, at random (a
    /// server only once it registered).
    fn pick(&mut self, prefix: &str) -> Result<(u32, Option<u32>), String> {
        let c: Vec<_> = self
            .plan
            .procs
            .list()
            .into_iter()
            .filter(|p| p.name.starts_with(prefix) && (prefix != "server" || p.rank.is_some()))
            .collect();
        if c.is_empty() {
            return Err(format!("no {prefix} process to inject a fault into"));
        }
        let p = &c[(self.next() % c.len() as u64) as usize];
        Ok((p.pid, p.rank))
    }

    fn inject(&mut self, kind: Kind) -> Result<String, String> {
        let signal = |pid: u32, s: Signal| kill(Pid::from_raw(pid as i32), s).map_err(|e| format!("{s} to pid {pid}: {e}"));
        match kind {
            Kind::ServerKill => {
                let (pid, rank) = self.pick("server")?;
                let rank = rank.unwrap_or(u32::MAX);
                signal(pid, Signal::SIGKILL)?;
                // Declared lost by the control plane, then replaced.
                self.wait_status(LOST_WITHIN, |t| lost(t, rank)).map_err(|e| format!("server {rank} killed: {e}"))?;
                self.live -= 1;
                self.scale_to(self.live + 1)?;
                Ok(format!("server {rank}, pid {pid}"))
            }
            Kind::ScaleOut | Kind::ScaleIn => {
                let (from, to) = (self.live, if kind == Kind::ScaleOut { self.live + 1 } else { self.live - 1 });
                self.scale_to(to)?;
                Ok(format!("{from} -> {to} servers"))
            }
            Kind::ServerStall | Kind::WorkerStall => {
                // Below the leases (servers 5 s, workers 10 s by default).
                let (prefix, lo, hi) = if kind == Kind::ServerStall { ("server", 0.5, 2.5) } else { ("worker", 1.0, 4.0) };
                let (pid, _) = self.pick(prefix)?;
                let d = self.uniform(lo, hi);
                signal(pid, Signal::SIGSTOP)?;
                std::thread::sleep(Duration::from_secs_f64(d));
                signal(pid, Signal::SIGCONT)?;
                Ok(format!("{prefix} pid {pid} stopped for {d:.1} s"))
            }
            Kind::ServerCut => {
                let (pid, rank) = self.pick("server")?;
                let rank = rank.unwrap_or(u32::MAX);
                let status = self.status().ok_or("no status from the control plane")?;
                let port = server_port(&status, rank).ok_or_else(|| format!("no address for server {rank} in the status"))?;
                let cut = cut_port(port)?;
                // Its peers report it; declared lost and fenced off (it
                // exits at its next order poll), then replaced.
                self.wait_status(LOST_WITHIN, |t| lost(t, rank)).map_err(|e| format!("server {rank} cut off: {e}"))?;
                self.live -= 1;
                self.scale_to(self.live + 1)?;
                Ok(format!("server {rank}, pid {pid}: {cut} connections to port {port} cut"))
            }
            Kind::ControlKill => {
                let (pid, _) = self.pick("control")?;
                signal(pid, Signal::SIGKILL)?;
                self.ctl = None;
                self.control_kills += 1;
                Ok(format!("pid {pid}"))
            }
        }
    }

    /// Back to normal: the job settled with every shard protected and
    /// training moving again.
    fn recover(&mut self, kind: Kind) -> Result<(), String> {
        let from = self.step();
        self.settled(SETTLE_WITHIN).map_err(|e| format!("after a {}: {e}", kind.name()))?;
        let until = Instant::now() + SETTLE_WITHIN;
        while self.step() < from + 2 && !self.over() {
            if Instant::now() > until {
                return Err(format!("after a {}: training made no progress for {} s", kind.name(), SETTLE_WITHIN.as_secs()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Asks the control plane for `n` servers (starting the new ones).
    fn scale_to(&mut self, n: u32) -> Result<(), String> {
        let deadline = Instant::now() + SETTLE_WITHIN;
        self.client()?
            .call_when_possible(&ControlMsg::Scale { servers: n }, deadline)
            .map_err(|e| format!("scale to {n} servers: {e}"))?;
        if n > self.live {
            let _ = self.plan.spawn.send(Spawn::Servers(n - self.live));
        }
        self.live = n;
        Ok(())
    }

    fn client(&mut self) -> Result<&mut ControlClient, String> {
        if self.ctl.is_none() {
            let c = ControlClient::connect(self.plan.control, &self.plan.secret, Duration::from_secs(30))
                .map_err(|e| format!("the control plane: {e}"))?;
            self.ctl = Some(c);
        }
        Ok(self.ctl.as_mut().expect("connected"))
    }

    /// The control plane's status report (reconnecting after a restart).
    /// The job's status as `eps status --json` has it (fields, not words).
    fn status(&mut self) -> Option<Value> {
        let r = self.client().ok()?.call(&ControlMsg::StatusJson);
        match r {
            Ok(ControlMsg::StatusReport { text }) => serde_json::from_str(&text).ok(),
            _ => {
                self.ctl = None;
                None
            }
        }
    }

    /// Waits until the status satisfies `ok` (or training ended).
    fn wait_status(&mut self, within: Duration, ok: impl Fn(&Value) -> bool) -> Result<(), String> {
        let until = Instant::now() + within;
        let mut last = Value::Null;
        while !self.over() {
            if let Some(t) = self.status() {
                if ok(&t) {
                    return Ok(());
                }
                last = t;
            }
            if Instant::now() > until {
                return Err(format!("not within {} s; the job's status:\n{last:#}", within.as_secs()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Waits for no migration in flight, no server joining and every shard
    /// with a synced backup.
    fn settled(&mut self, within: Duration) -> Result<(), String> {
        self.wait_status(within, settled).map_err(|e| format!("the job did not settle: {e}"))
    }
}

/// No migration, split or bucket move in flight, no server joining, every
/// shard backed up, and every server's table rows whole on their backup (no
/// lost server's rows still served by a stand-in).
pub fn settled(t: &Value) -> bool {
    let n = |k: &str| t.get(k).and_then(Value::as_u64);
    let shards = n("shards");
    shards.is_some()
        && n("shards_protected") == shards
        && n("migrations_in_flight") == Some(0)
        && n("servers_joining") == Some(0)
        && t.get("splitting").and_then(Value::as_bool) == Some(false)
        && t.get("buckets_moving").and_then(Value::as_bool) == Some(false)
        && n("row_holders_protected") == n("row_holders")
        && n("rows_standing_in") == Some(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_port_and_loss_come_from_its_status_row() {
        let t = serde_json::json!({"servers": [
            {"rank": 1, "state": "serving", "addr": "127.0.0.1:40123"},
            {"rank": 2, "state": "lost", "addr": "127.0.0.1:5"},
        ]});
        assert_eq!(server_port(&t, 1), Some(40123));
        assert_eq!(server_port(&t, 2), Some(5));
        assert_eq!(server_port(&t, 3), None);
        assert!(lost(&t, 2) && !lost(&t, 1) && !lost(&t, 3));
    }

    #[test]
    fn settled_needs_every_shard_and_row_protected_and_nothing_moving() {
        let base = serde_json::json!({"shards": 17, "shards_protected": 17, "migrations_in_flight": 0,
            "servers_joining": 0, "splitting": false, "buckets_moving": false, "row_holders": 3,
            "row_holders_protected": 3, "rows_standing_in": 0});
        assert!(settled(&base));
        let with = |k: &str, v: Value| {
            let mut t = base.clone();
            t[k] = v;
            t
        };
        assert!(!settled(&with("shards_protected", 16.into())));
        assert!(!settled(&with("migrations_in_flight", 1.into())));
        assert!(!settled(&with("servers_joining", 1.into())));
        assert!(!settled(&with("splitting", true.into())));
        assert!(!settled(&with("buckets_moving", true.into())));
        assert!(!settled(&with("row_holders_protected", 2.into())));
        assert!(!settled(&with("rows_standing_in", 1.into())));
        assert!(!settled(&serde_json::json!({})), "no figures");
    }
}
