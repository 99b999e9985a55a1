//! A local cluster as child processes of this one: a control plane with its
//! file-backed store in a temporary directory, the servers and the workers. Dropping
//! it stops every process still running; Ctrl-C or a failing process ends
//! [`LocalCluster::supervise`] with an error.

use crate::report::Report;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use eps_proto::JobSpec;

use crate::error::{TrainError, field};
use crate::scale::Spawn;
use crate::slurm::Steps;
use crate::slurm::steps::Role;

/// Flags for the processes of a cluster, and how they are started.
#[derive(Clone, Debug, Default)]
pub struct ChildArgs {
    /// For servers and workers (the transport).
    pub both: Vec<String>,
    /// For servers only (the aggregator).
    pub servers: Vec<String>,
    /// Each process a Slurm job step of this allocation (else a child
    /// process of this one).
    pub slurm: Option<Steps>,
    /// Every process serves `/metrics` and `/healthz` on a port of its own
    /// (`--metrics IP:0`; each says where).
    pub metrics: bool,
    /// The job's state in etcd (else the embedded store in the cluster's
    /// directory), with this many control planes (one leads, the others
    /// stand by).
    pub etcd: Option<eps_etcd::store::EtcdTarget>,
    pub control_planes: u32,
}

/// A local cluster on the `soft` transport and the CPU aggregator (the benchmarks
/// measure those).
pub fn soft_args() -> ChildArgs {
    ChildArgs {
        both: vec!["--transport".into(), "soft".into()],
        servers: vec!["--aggregator".into(), "cpu".into()],
        ..ChildArgs::default()
    }
}

/// How [`LocalCluster::launch`] starts a cluster.
#[derive(Clone, Debug)]
pub struct Launch {
    /// The control plane's listen address (`IP:PORT`; port 0: any).
    pub listen: String,
    /// The job secret (default: `EPS_JOB_SECRET`, else the spec's, else a
    /// new random one).
    pub secret: Option<String>,
    /// Start `job.workers` `eps worker` processes (else the workers come from
    /// elsewhere: a framework's processes).
    pub workers: bool,
    /// Where the first servers and workers go, as (node, servers, workers)
    /// (Slurm steps: `--nodelist`; child processes run here anyway); the
    /// rest go where the launcher puts them.
    pub nodes: Vec<(String, u32, u32)>,
}

/// The running processes of one job.
pub struct LocalCluster {
    children: Vec<(String, Child)>,
    dir: PathBuf,
    lines: mpsc::Receiver<String>,
    /// Threads forwarding worker stdout; they end at EOF.
    readers: Vec<std::thread::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    exe: PathBuf,
    secret: String,
    /// Control-plane addresses (`A[,B,C]`).
    addr: String,
    /// Each control plane's address (a restart listens there again).
    control_addrs: Vec<String>,
    /// The job's state in etcd (removed once the job is over), and the job.
    etcd: Option<(eps_etcd::store::EtcdTarget, String)>,
    servers_started: u32,
    workers_started: u32,
    /// Extra arguments of every `eps worker`.
    worker_args: Vec<String>,
    /// The flags every server gets (transport, aggregator).
    server_args: Vec<String>,
    /// Where worker stdout lines go.
    tx: mpsc::Sender<String>,
    /// The control plane's arguments, to restart it on its address and store.
    control_args: Vec<String>,
    /// Restarts of the control plane so far.
    control_restarts: u32,
    /// By server process name: its rank, once it registered.
    server_ranks: Vec<(String, Arc<std::sync::OnceLock<u32>>)>,
    /// Shards have backups: a server that dies does not stop the job.
    replicated: bool,
    /// The processes running now, for whoever watches or injects faults.
    procs: Processes,
    /// Processes are Slurm job steps (each child is its `srun`).
    slurm: Option<Steps>,
    /// Under Slurm: the spec's text (the control plane reads it on stdin, on
    /// whichever node it runs) and the node its state is on (a restart goes
    /// there).
    spec_text: String,
    control_node: Option<String>,
    /// The nodes of the next servers and workers to start (see [`Launch::nodes`]).
    server_nodes: std::collections::VecDeque<String>,
    worker_nodes: std::collections::VecDeque<String>,
}

/// One running process of a local cluster.
#[derive(Clone, Debug)]
pub struct Proc {
    /// `control plane`, `server process N` or `worker process N`.
    pub name: String,
    pub pid: u32,
    /// A server's rank, once it registered.
    pub rank: Option<u32>,
}

/// The processes of a local cluster running now (shared: the cluster adds
/// those it starts and removes those that exited).
#[derive(Clone, Debug, Default)]
pub struct Processes(Arc<std::sync::Mutex<Vec<Running>>>);

/// A process's name, pid and, for a server, where its rank will be.
type Running = (String, u32, Option<Arc<std::sync::OnceLock<u32>>>);

impl Processes {
    fn add(&self, name: &str, pid: u32, rank: Option<Arc<std::sync::OnceLock<u32>>>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push((name.to_string(), pid, rank));
    }

    fn remove(&self, pid: u32) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).retain(|p| p.1 != pid);
    }

    /// The processes running now.
    pub fn list(&self) -> Vec<Proc> {
        let l = self.0.lock().unwrap_or_else(|p| p.into_inner());
        l.iter()
            .map(|(name, pid, r)| Proc { name: name.clone(), pid: *pid, rank: r.as_ref().and_then(|r| r.get().copied()) })
            .collect()
    }
}

/// The control plane's name among the children.
const CONTROL: &str = "control plane";
/// Restarts of a control plane that keeps dying before the cluster gives up.
const CONTROL_RESTARTS: u32 = 3;

impl std::fmt::Debug for LocalCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCluster").field("processes", &self.children.len()).finish()
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        if self.slurm.is_some() {
            // `srun` passes SIGTERM on to its step and exits once the step
            // ended; a SIGKILL would leave the step running in the allocation.
            for (_, c) in &mut self.children {
                if let (Ok(None), Ok(pid)) = (c.try_wait(), i32::try_from(c.id())) {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
                }
            }
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until && self.children.iter_mut().any(|(_, c)| matches!(c.try_wait(), Ok(None))) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        for (_, c) in &mut self.children {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap_or(".")
}

/// Set by Ctrl-C (SIGINT, SIGTERM): every cluster of the process stops.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Installs the process's Ctrl-C handler once.
fn on_ctrl_c() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = ctrlc::set_handler(|| INTERRUPTED.store(true, Ordering::SeqCst));
    });
}

/// Whether Ctrl-C was pressed (every local cluster of this process stops).
pub fn interrupted() -> bool {
    on_ctrl_c();
    INTERRUPTED.load(Ordering::SeqCst)
}

impl LocalCluster {
    /// Starts the control plane, `spec.job.servers` servers and `spec.job.workers`
    /// workers (`eps worker` with `worker_args`), servers and workers with
    /// `children.both` (the transport flags), servers with `children.servers` too.
    /// Worker stdout lines are collected.
    pub fn start(spec: &JobSpec, spec_text: &str, worker_args: &[&str], children: &ChildArgs) -> Result<Self, TrainError> {
        let how = Launch { listen: "127.0.0.1:0".into(), secret: None, workers: true, nodes: Vec::new() };
        Self::launch(spec, spec_text, worker_args, children, &how)
    }

    /// As [`LocalCluster::start`], with the control plane's address, the job
    /// secret and whether to start the workers given by `how`.
    pub fn launch(
        spec: &JobSpec,
        spec_text: &str,
        worker_args: &[&str],
        children: &ChildArgs,
        how: &Launch,
    ) -> Result<Self, TrainError> {
        let stop = Arc::new(AtomicBool::new(false));
        on_ctrl_c();
        let exe =
            std::env::current_exe().map_err(|source| TrainError::Spawn { what: "eps (current executable)".into(), source })?;
        // The job secret: given, else the environment's (so that `eps status`
        // can ask), else the spec's, else a new one.
        let from_env = std::env::var("EPS_JOB_SECRET").ok().filter(|s| !s.is_empty());
        let secret = how.secret.clone().or(from_env).or_else(|| spec.job.secret.clone()).unwrap_or_else(|| {
            eps_fabric::auth::nonce().map(|n| n.iter().map(|b| format!("{b:02x}")).collect()).unwrap_or_else(|_| "eps".into())
        });
        let tag: String =
            eps_fabric::auth::nonce().map(|n| n[..4].iter().map(|b| format!("{b:02x}")).collect()).unwrap_or_default();
        let dir = std::env::temp_dir().join(format!("eps-cluster-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| TrainError::Spawn { what: "a temporary directory".into(), source })?;
        let spec_path = dir.join("job.toml");
        std::fs::write(&spec_path, spec_text).map_err(|source| TrainError::Spawn { what: "the job spec file".into(), source })?;
        let (tx, lines) = mpsc::channel::<String>();
        let mut cl = Self {
            children: Vec::new(),
            dir: dir.clone(),
            lines,
            readers: Vec::new(),
            stop,
            exe: exe.clone(),
            secret: secret.clone(),
            addr: String::new(),
            control_addrs: Vec::new(),
            etcd: None,
            servers_started: 0,
            workers_started: 0,
            worker_args: worker_args.iter().map(|a| a.to_string()).chain(children.both.iter().cloned()).collect(),
            server_args: children.both.iter().chain(&children.servers).cloned().collect(),
            tx,
            control_args: Vec::new(),
            control_restarts: 0,
            server_ranks: Vec::new(),
            replicated: false,
            procs: Processes::default(),
            slurm: children.slurm.clone(),
            spec_text: spec_text.to_string(),
            control_node: None,
            server_nodes: how.nodes.iter().flat_map(|(n, s, _)| std::iter::repeat_n(n.clone(), *s as usize)).collect(),
            worker_nodes: how.nodes.iter().flat_map(|(n, _, w)| std::iter::repeat_n(n.clone(), *w as usize)).collect(),
        };
        let state = dir.join("state");
        let store = match &children.etcd {
            Some(t) => {
                // Unreachable, or another run's job: said now, before any process starts.
                let secret = eps_fabric::Secret::new(secret.as_str()).map_err(|e| TrainError::Child(e.to_string()))?;
                crate::ha::open(t, spec, &secret).map_err(TrainError::Child)?;
                cl.etcd = Some((t.clone(), spec.job.name.clone()));
                ["--store".to_string(), t.to_string()]
            }
            None => ["--state-dir".to_string(), path_str(&state).to_string()],
        };
        let ctl_args = match &children.slurm {
            None => ["control", "--listen", &how.listen, "--spec", path_str(&spec_path)]
                .into_iter()
                .map(str::to_string)
                .chain(store)
                .chain(["--exit-with-parent".to_string()])
                .collect(),
            Some(s) => {
                vec![
                    "control".into(),
                    "--listen".into(),
                    s.control_listen(),
                    "--spec".into(),
                    "-".into(),
                    "--state-dir".into(),
                    s.state_dir(&tag),
                ]
            }
        };
        if let Some(s) = &cl.slurm {
            eps_proto::say!("eps: Slurm job {}: every process runs as a job step", s.job());
            // Servers listen on the address their node reaches the control plane from.
            cl.server_args.extend(["--listen-ip".into(), "route".into()]);
            // A server's step with CPUs to spare splits large updates over two threads.
            if spec.slurm.server_cpus > 1 {
                cl.server_args.extend(["--threads".into(), "2".into()]);
            }
        }
        cl.control_args = ctl_args;
        if children.metrics {
            // Any port; reachable from other nodes when they are Slurm steps.
            let at = if cl.slurm.is_some() { "0.0.0.0:0" } else { "127.0.0.1:0" };
            for v in [&mut cl.control_args, &mut cl.server_args, &mut cl.worker_args] {
                v.extend(["--metrics".to_string(), at.to_string()]);
            }
        }
        for k in 0..children.control_planes.max(1) {
            // A restart listens where the first one did.
            let addr = cl.start_control(k)?;
            cl.control_addrs.push(addr);
        }
        cl.addr = cl.control_addrs.join(",");
        for _ in 0..spec.job.servers {
            cl.spawn_server()?;
        }
        for _ in 0..if how.workers { spec.job.workers } else { 0 } {
            cl.spawn_worker()?;
        }
        Ok(cl)
    }

    /// What is known of a server process that died: its rank and, from the
    /// control plane, the shards it held.
    fn server_lost(&self, name: String, status: String) -> TrainError {
        let rank = self.server_ranks.iter().find(|(n, _)| *n == name).and_then(|(_, r)| r.get().copied());
        let held = rank
            .and_then(|r| {
                let prefix = format!("server {r}: ");
                self.status_text()?.lines().find_map(|l| l.trim().strip_prefix(&prefix).map(str::to_string))
            })
            .unwrap_or_default();
        TrainError::ServerLost { name, rank, status, held }
    }

    /// The control plane's status report, if it answers.
    fn status_text(&self) -> Option<String> {
        let addr: eps_control::ControlAddrs = self.addr.parse().ok()?;
        let secret = eps_fabric::Secret::new(self.secret.as_str()).ok()?;
        let mut c = eps_control::ControlClient::connect(addr, &secret, Duration::from_secs(2)).ok()?;
        match c.call(&eps_proto::control::ControlMsg::Status).ok()? {
            eps_proto::control::ControlMsg::StatusReport { text } => Some(text),
            _ => None,
        }
    }

    /// With replicas, after servers died: a lost server that still owns
    /// shards lost them for good (their backups died too, or were still being
    /// rebuilt). `died` names the dead server processes and how they exited.
    fn shards_lost_for_good(&self, died: &[(String, String)]) -> Option<TrainError> {
        // Decided on the status's fields (`eps status --json`), not its words.
        let addr: eps_control::ControlAddrs = self.addr.parse().ok()?;
        let secret = eps_fabric::Secret::new(self.secret.as_str()).ok()?;
        let mut c = eps_control::ControlClient::connect(addr, &secret, Duration::from_secs(2)).ok()?;
        let eps_proto::control::ControlMsg::StatusReport { text } = c.call(&eps_proto::control::ControlMsg::StatusJson).ok()?
        else {
            return None;
        };
        let st: serde_json::Value = serde_json::from_str(&text).ok()?;
        st.get("servers")?.as_array()?.iter().find_map(|s| {
            let rank = u32::try_from(s.get("rank")?.as_u64()?).ok()?;
            let owned = s.get("shards")?.as_u64()?;
            (s.get("state")?.as_str()? == "lost" && owned > 0).then(|| {
                let name = self.server_ranks.iter().find(|(_, r)| r.get() == Some(&rank)).map(|(n, _)| n.clone());
                let name = name.unwrap_or_else(|| format!("server {rank}"));
                let status = died.iter().find(|(n, _)| *n == name).map_or("a failure".to_string(), |(_, s)| s.clone());
                let held = format!("lost, {owned} shards; their backups were lost too");
                TrainError::ServerLost { name, rank: Some(rank), status, held }
            })
        })
    }

    /// Starts control plane `k` (on its address, if it had one); returns
    /// the address it listens on.
    fn start_control(&mut self, k: u32) -> Result<String, TrainError> {
        if let Some(a) = self.control_addrs.get(k as usize) {
            self.control_args[2] = a.clone();
        }
        let name = if k == 0 { CONTROL.to_string() } else { format!("{CONTROL} {}", k + 1) };
        let mut cmd = match &self.slurm {
            None => Command::new(&self.exe),
            Some(s) => s.command(&self.exe, Role::Control, self.control_restarts, self.control_node.as_deref(), &[]),
        };
        let stdin = if self.slurm.is_some() { Stdio::piped() } else { Stdio::null() };
        let mut control = cmd
            .args(&self.control_args)
            .env("EPS_JOB_SECRET", &self.secret)
            .env("EPS_LOG_FORMAT", eps_metrics::log::format().name())
            // Its state directory is on its node: gone once the job ends.
            .env("EPS_DISCARD_STATE", if self.slurm.is_some() { "1" } else { "0" })
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| TrainError::Spawn { what: "the control plane".into(), source })?;
        if let Some(mut w) = control.stdin.take() {
            // `--spec -`: the spec travels with the step, wherever it runs.
            std::io::Write::write_all(&mut w, self.spec_text.as_bytes())
                .map_err(|e| TrainError::Child(format!("control plane: cannot hand it the spec: {e}")))?;
        }
        let out = control.stdout.take().expect("piped");
        self.procs.add(&name, control.id(), None);
        self.children.push((name, control));
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).map_err(|e| TrainError::Child(format!("control plane: {e}")))?;
        if let Some(n) = field(&line, "node") {
            self.control_node = Some(n.to_string());
        }
        field(&line, "addr")
            .map(str::to_string)
            .ok_or_else(|| TrainError::Child("the control plane did not start (see its message above)".into()))
    }

    /// Starts one more worker process; its stdout lines are collected. (It
    /// registers with the control plane, which must have a rank for it: see `eps
    /// scale`.)
    pub fn spawn_worker(&mut self) -> Result<(), TrainError> {
        let name = format!("worker process {}", self.workers_started);
        let node = self.worker_nodes.pop_front();
        let mut c = self.role(Role::Worker, self.workers_started, node.as_deref(), &self.worker_args, &name)?;
        let out = c.stdout.take().expect("piped");
        let tx = self.tx.clone();
        self.readers.push(std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        }));
        self.procs.add(&name, c.id(), None);
        self.children.push((name, c));
        self.workers_started += 1;
        Ok(())
    }

    /// Starts the `n`th `eps ROLE --control ADDR` (a child, or a Slurm step
    /// on `node` if given) with the job secret in its environment and its
    /// stdout piped.
    fn role(&self, role: Role, n: u32, node: Option<&str>, extra: &[String], name: &str) -> Result<Child, TrainError> {
        let verb = if role == Role::Server { "server" } else { "worker" };
        let mut args: Vec<String> = vec![verb.into(), "--control".into(), self.addr.clone()];
        let mut cmd = match &self.slurm {
            None => {
                args.push("--exit-with-parent".into());
                Command::new(&self.exe)
            }
            // A step's parent is Slurm's, which ends the step when its srun goes.
            Some(s) => s.command(&self.exe, role, n, node, &[]),
        };
        cmd.args(args)
            .args(extra)
            .env("EPS_JOB_SECRET", &self.secret)
            .env("EPS_LOG_FORMAT", eps_metrics::log::format().name())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| TrainError::Spawn { what: name.to_string(), source })
    }

    /// A flag that, set, makes [`LocalCluster::supervise`] stop every
    /// process of the cluster and return [`TrainError::Stopped`].
    pub fn stop_handle(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// The processes running now (kept up to date while the cluster runs).
    pub fn processes(&self) -> Processes {
        self.procs.clone()
    }

    /// The control plane's address.
    pub fn control_addr(&self) -> &str {
        &self.addr
    }

    /// The job secret the processes share.
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// The cluster's private directory (the spec, the control plane's state),
    /// removed when the cluster is dropped.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts one more server process (it registers with the control plane, which
    /// must have room for it: see `eps scale`).
    pub fn spawn_server(&mut self) -> Result<(), TrainError> {
        let name = format!("server process {}", self.servers_started);
        let node = self.server_nodes.pop_front();
        let mut c = self.role(Role::Server, self.servers_started, node.as_deref(), &self.server_args, &name)?;
        let out = c.stdout.take().expect("piped");
        let rank = Arc::new(std::sync::OnceLock::new());
        let r = rank.clone();
        let tx = self.tx.clone();
        self.readers.push(std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                match Report::parse(&l) {
                    Some(Report::Server { rank }) => {
                        let _ = r.set(rank);
                    }
                    // What a server's sparse tables held, for whoever supervises.
                    Some(Report::ServerSparse(_)) => {
                        let _ = tx.send(l);
                    }
                    _ => {}
                }
            }
        }));
        self.procs.add(&name, c.id(), Some(rank.clone()));
        self.server_ranks.push((name.clone(), rank));
        self.children.push((name, c));
        self.servers_started += 1;
        Ok(())
    }

    /// Feeds every worker line to `on_line` until all processes have exited; fails
    /// at once (stopping the rest) on Ctrl-C or when a process exits with an error.
    /// Each request received on `more` starts that many more servers or workers.
    /// Returns the number of worker processes started in all.
    pub fn supervise(self, more: Option<&mpsc::Receiver<Spawn>>, on_line: impl FnMut(&str)) -> Result<u32, TrainError> {
        self.watch(more, on_line, false).map(|(started, _)| started)
    }

    /// As [`LocalCluster::supervise`], except that a worker process that dies
    /// does not stop the cluster: the job goes on without it once its lease
    /// runs out (the control plane removes it at the next iteration boundary);
    /// with `replicated`, neither does a server (its shards' backups take over).
    /// Returns the worker processes started and those that died.
    pub fn supervise_tolerant(
        mut self,
        more: Option<&mpsc::Receiver<Spawn>>,
        replicated: bool,
        on_line: impl FnMut(&str),
    ) -> Result<(u32, u32), TrainError> {
        self.replicated = replicated;
        self.watch(more, on_line, true)
    }

    fn watch(
        mut self,
        more: Option<&mpsc::Receiver<Spawn>>,
        mut on_line: impl FnMut(&str),
        tolerant: bool,
    ) -> Result<(u32, u32), TrainError> {
        let mut died = 0;
        // With replicas: the servers that died, and when the control plane was
        // last asked whether shards were lost with them.
        let mut servers_died: Vec<(String, String)> = Vec::new();
        let mut asked = Instant::now();
        // The control plane exited with success: the job is over, and a server
        // still waiting to register (a scale event at the end) is not needed.
        let mut job_over = false;
        loop {
            if !servers_died.is_empty() && asked.elapsed() > Duration::from_millis(500) {
                asked = Instant::now();
                if let Some(e) = self.shards_lost_for_good(&servers_died) {
                    return Err(e);
                }
            }
            if INTERRUPTED.load(Ordering::SeqCst) {
                return Err(TrainError::Interrupted);
            }
            if self.stop.load(Ordering::SeqCst) {
                return Err(TrainError::Stopped);
            }
            while let Some(k) = more.and_then(|r| r.try_recv().ok()) {
                match k {
                    Spawn::Servers(n) => (0..n).try_for_each(|_| self.spawn_server())?,
                    Spawn::Workers(n) => (0..n).try_for_each(|_| self.spawn_worker())?,
                }
            }
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(100)) {
                on_line(&l);
            }
            let mut running = 0;
            let mut control_died = None;
            let mut gone = Vec::new();
            let mut lost_servers = 0;
            for (i, (name, c)) in self.children.iter_mut().enumerate() {
                let exited = c.try_wait();
                if let Ok(Some(_)) = exited {
                    // Reaped: its pid may be reused from now on.
                    self.procs.remove(c.id());
                }
                let unregistered = |n: &str| !self.server_ranks.iter().any(|(s, r)| s == n && r.get().is_some());
                match exited {
                    Ok(None) if job_over && name.starts_with("server") && unregistered(name) => {
                        // (A process this cluster started, by its handle.)
                        let _ = c.kill();
                        running += 1;
                    }
                    Ok(None) => running += 1,
                    Ok(Some(st)) if st.success() && name.starts_with(CONTROL) => job_over = true,
                    Ok(Some(_)) if job_over && name.starts_with("server") && unregistered(name) => {
                        eps_proto::say!("eps train: {name} was not needed: the job ended before it registered");
                        gone.push(i);
                        lost_servers += 1;
                    }
                    Ok(Some(st)) if !st.success() && tolerant && name.starts_with("worker") => {
                        eps_proto::say!(
                            "eps train: {name} (pid {}) exited with {st}; the job goes on without it once its lease runs out",
                            c.id()
                        );
                        gone.push(i);
                    }
                    Ok(Some(st)) if !st.success() && name.starts_with(CONTROL) && self.control_restarts < CONTROL_RESTARTS => {
                        let how = if self.etcd.is_some() { "as a standby" } else { "from its store" };
                        eps_proto::say!("eps train: {name} (pid {}) exited with {st}; restarting it {how}", c.id());
                        let k = name.strip_prefix(CONTROL).and_then(|n| n.trim().parse::<u32>().ok()).map_or(0, |n| n - 1);
                        control_died = Some((i, k));
                    }
                    Ok(Some(st)) if !st.success() && self.replicated && name.starts_with("server") => {
                        eps_proto::say!("eps train: {name} (pid {}) exited with {st}; its shards' backups take over", c.id());
                        servers_died.push((name.clone(), st.to_string()));
                        gone.push(i);
                        lost_servers += 1;
                    }
                    Ok(Some(st)) if !st.success() && name.starts_with("server") => {
                        if unregistered(name) {
                            // It held nothing: say so rather than name lost shards.
                            return Err(TrainError::Child(format!(
                                "{name} exited with {st} before it registered with the control plane (see its messages above); stopped the cluster"
                            )));
                        }
                        let name = name.clone();
                        return Err(self.server_lost(name, st.to_string()));
                    }
                    Ok(Some(st)) if !st.success() => {
                        return Err(TrainError::Child(format!("{name} (pid {}) exited with {st}; stopped the cluster", c.id())));
                    }
                    _ => {}
                }
            }
            died += gone.len() as u32 - lost_servers;
            if died > 0 && died == self.workers_started {
                // Workers give up on shards nobody holds: say so, if that is why
                // (the control plane declares a dead server lost after a grace).
                let until = Instant::now() + Duration::from_secs(3);
                while !servers_died.is_empty() && Instant::now() < until {
                    if let Some(e) = self.shards_lost_for_good(&servers_died) {
                        return Err(e);
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                return Err(TrainError::Child("every worker process died; stopped the cluster".into()));
            }
            let mut remove: Vec<usize> = gone.into_iter().chain(control_died.map(|(i, _)| i)).collect();
            remove.sort_unstable();
            for &i in remove.iter().rev() {
                self.children.remove(i);
            }
            if let Some((_, k)) = control_died {
                // Nothing on the data path waits for it: training goes on while
                // it restarts (or a standby takes over); servers and workers reconnect.
                self.control_restarts += 1;
                self.start_control(k)?;
                running += 1;
            }
            if running == 0 {
                // Lines printed just before the last exit may still be in the pipes:
                // the readers end at EOF, after forwarding them.
                for r in self.readers.drain(..) {
                    let _ = r.join();
                }
                while let Ok(l) = self.lines.try_recv() {
                    on_line(&l);
                }
                if let Some((t, job)) = &self.etcd
                    && let Err(e) = crate::ha::discard(t, job)
                {
                    eps_proto::say!("eps train: the job is over but its state in {t} could not be removed: {e}");
                }
                return Ok((self.workers_started, died));
            }
        }
    }
}
