//! Network faults on a real link: one server of a job runs in a network
//! namespace this test creates, behind a veth pair; the rest of the job runs
//! on the host side of it. A link cut (the veth set down) leaves every
//! connection to that server open and silent: with two replicas the server is
//! lost when its lease lapses, its backups take over, the job ends with the
//! parameters of an uninterrupted run, and once the link is back the server
//! learns it was lost and exits. A slow link (a tbf rate limit) only slows
//! the job: it ends with the same parameters. Needs root and `ip` (iproute2);
//! without them the tests say they skipped.

use eps::report::Report;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::cli::{Lines, SMALL_JOB, eps, json_field as json, tmp};

const SECRET: &str = "netfaults-test-secret-0123456789";

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// A namespace joined to the host by a veth pair: `host` (10.91.N.1) on this
/// side, 10.91.N.2 inside. Removed when dropped.
struct Link {
    ns: String,
    host: String,
    subnet: u8,
}

impl Link {
    /// None (the test skips, saying so) without the rights or tools to make one.
    fn new(subnet: u8) -> Option<Self> {
        let id = std::process::id() % 100_000;
        let (ns, host, inner) = (format!("eps-nf{id}-{subnet}"), format!("enf{id}h{subnet}"), format!("enf{id}n{subnet}"));
        let link = Self { ns: ns.clone(), host: host.clone(), subnet };
        let (h, n) = (format!("10.91.{subnet}.1/24"), format!("10.91.{subnet}.2/24"));
        let ok = ip(&["netns", "add", &ns])
            && ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner])
            && ip(&["link", "set", &inner, "netns", &ns])
            && ip(&["addr", "add", &h, "dev", &host])
            && ip(&["link", "set", &host, "up"])
            && ip(&["-n", &ns, "addr", "add", &n, "dev", &inner])
            && ip(&["-n", &ns, "link", "set", &inner, "up"])
            && ip(&["-n", &ns, "link", "set", "lo", "up"]);
        if !ok {
            eps_etcd::testing::skip(
                "tests/netfaults.rs",
                "cannot create a network namespace and a veth pair here (needs root and iproute2)",
            );
        }
        ok.then_some(link)
    }

    fn host_ip(&self) -> String {
        format!("10.91.{}.1", self.subnet)
    }

    fn inner_ip(&self) -> String {
        format!("10.91.{}.2", self.subnet)
    }

    fn set(&self, up: bool) {
        assert!(ip(&["link", "set", &self.host, if up { "up" } else { "down" }]), "cannot set {} {up}", self.host);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        ip(&["link", "del", &self.host]);
        ip(&["netns", "del", &self.ns]);
    }
}

/// A job of separate processes: a control plane and two servers on the host
/// side, one server in the namespace, two workers on the host side.
struct Job {
    children: Vec<(String, Child)>,
    /// Every line the processes print, tagged with the process.
    lines: Lines,
}

impl Job {
    fn start(link: &Link, spec: &str) -> Self {
        let mut job = Self { children: Vec::new(), lines: Lines::default() };
        let host = link.host_ip();
        let state = tmp("netfaults", &format!("state-{}", link.subnet));
        let listen = format!("{host}:0");
        let args = ["control", "--listen", &listen, "--spec", spec, "--state-dir", state.to_str().unwrap()];
        job.spawn("control", eps().args(args));
        let control = job.lines.line("eps control: job").split(" on ").nth(1).and_then(|r| r.split(':').nth(1)).map(|p| {
            let port: String = p.chars().take_while(char::is_ascii_digit).collect();
            format!("{host}:{port}")
        });
        let control = control.expect("the control plane's address");
        let server = ["server", "--control", &control, "--transport", "soft", "--aggregator", "cpu", "--exit-with-parent"];
        for i in 0..2 {
            job.spawn(&format!("server-host-{i}"), eps().args(server).args(["--listen-ip", &host]));
        }
        let bin = eps().get_program().to_owned();
        let mut inner = Command::new("ip");
        inner.args(["netns", "exec", &link.ns]).arg(bin).args(server).args(["--listen-ip", &link.inner_ip()]);
        inner.env("EPS_JOB_SECRET", SECRET);
        job.spawn("server-ns", &mut inner);
        for i in 0..2 {
            let w = ["worker", "--control", &control, "--transport", "soft", "--progress-every", "5", "--exit-with-parent"];
            job.spawn(&format!("worker-{i}"), eps().args(w));
        }
        job
    }

    fn spawn(&mut self, name: &str, cmd: &mut Command) {
        let mut c = cmd.env("EPS_JOB_SECRET", SECRET).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let tag = format!("[{name}] ");
        self.lines.collect(c.stdout.take().unwrap(), &tag);
        self.lines.collect(c.stderr.take().unwrap(), &tag);
        self.children.push((name.to_string(), c));
    }

    /// Waits for a worker's progress line at `step` or later.
    fn wait_step(&mut self, step: u64) {
        self.lines
            .until(&format!("progress at step {step}"), |l| matches!(report(l), Some(Report::Progress(p)) if p.step >= step));
    }

    /// Waits for every process to exit; returns the exit status by process.
    fn finish(&mut self) -> Vec<(String, bool)> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut out = Vec::new();
        for (name, c) in &mut self.children {
            loop {
                if let Some(st) = c.try_wait().unwrap() {
                    out.push((name.clone(), st.success()));
                    break;
                }
                assert!(Instant::now() < deadline, "{name} never exited");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.lines.rest(Duration::from_millis(500));
        out
    }

    fn log(&self) -> String {
        self.lines.text()
    }

    /// The final parameters' checksum, from the worker that evaluated them.
    fn checksum(&self) -> String {
        let done = self.lines.seen.iter().find_map(|l| match report(l) {
            Some(Report::Done(d)) => d.result,
            _ => None,
        });
        done.expect("a worker's evaluation").params_checksum
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The report on a line tagged with its process's name.
fn report(l: &str) -> Option<Report> {
    Report::parse(&l[l.find(eps::report::PREFIX)?..])
}

/// The spec of the job (3 servers, `steps`), and the checksum an
/// uninterrupted run of it ends with.
fn job_and_reference(name: &str, steps: u64, replicas: u32) -> (std::path::PathBuf, String) {
    let text = SMALL_JOB.replace("servers = 2", "servers = 3").replace("steps = 300", &format!("steps = {steps}"));
    let plain = tmp("netfaults", name).with_extension("toml");
    std::fs::write(&plain, &text).unwrap();
    let o: Output = eps().args(["train", "--json", "--spec", plain.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = json(&String::from_utf8_lossy(&o.stdout), "params_checksum");
    let extra = format!("[job]\nreplicas = {replicas}\nserver_lease_ms = 2000");
    std::fs::write(&plain, text.replace("[job]", &extra)).unwrap();
    (plain, want)
}

#[test]
fn a_server_cut_off_by_its_link_with_two_replicas_is_lost_and_nothing_is_lost() {
    let Some(link) = Link::new(1) else { return };
    // Long enough that the job still trains when the link comes back (the
    // control plane must be there to tell the server it was lost).
    let (spec, want) = job_and_reference("cut", 3000, 2);
    let mut job = Job::start(&link, spec.to_str().unwrap());
    job.wait_step(60);
    let since = job.lines.seen.len();
    link.set(false);
    job.lines.all_of(since, &["has not polled for orders", "is served here from version"]);
    job.wait_step(250);
    // Back on the link, the server asks for orders and is told it was lost.
    link.set(true);
    let status = job.finish();
    let log = job.log();
    for (name, ok) in &status {
        assert_eq!(*ok, name != "server-ns", "{name} exit status:\n{log}");
    }
    assert!(log.contains("[server-ns] eps: error") && log.contains("was declared lost"), "{log}");
    assert_eq!(job.checksum(), want, "{log}");
    if std::env::var_os("EPS_TEST_LOG").is_some() {
        eprintln!("{log}");
    }
    std::fs::remove_file(&spec).ok();
}

#[test]
fn a_slow_link_slows_the_job_and_changes_nothing() {
    let Some(link) = Link::new(2) else { return };
    let (spec, want) = job_and_reference("slow", 300, 1);
    // 40 Mbit/s to the namespace's server, queued up to 50 ms.
    let tbf = ["qdisc", "add", "dev", &link.host, "root", "tbf", "rate", "40mbit", "burst", "64kb", "latency", "50ms"];
    if !Command::new("tc").args(tbf).status().is_ok_and(|s| s.success()) {
        eps_etcd::testing::skip("a_slow_link_slows_the_job_and_changes_nothing", "tc cannot add a tbf rate limit here");
        return;
    }
    let started = Instant::now();
    let mut job = Job::start(&link, spec.to_str().unwrap());
    let status = job.finish();
    eprintln!("through the rate-limited link: {:.1} s", started.elapsed().as_secs_f64());
    let log = job.log();
    assert!(status.iter().all(|(_, ok)| *ok), "{status:?}\n{log}");
    assert_eq!(job.checksum(), want, "{log}");
    std::fs::remove_file(&spec).ok();
}
