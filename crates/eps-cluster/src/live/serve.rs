//! `eps sched serve`: the scheduler as a service on this machine, taking jobs
//! from `eps submit`, listing them for `eps jobs`, killing them for `eps
//! kill`. Requests come over a Unix socket only this user can open
//! (`$XDG_RUNTIME_DIR/eps-sched.sock`, else `/tmp/eps-sched-UID.sock`): one
//! request per connection, a command line and a body; the answer is `ok` and
//! a text, or `error: ` and why.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use eps_sched::JobSpec;
use serde::Deserialize;

use super::{Config, JobState, Source, launcher};

/// Largest request read.
const MAX_REQUEST: u64 = 1 << 20;

/// The socket path when none is given.
pub fn default_socket() -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| Path::new(d).is_dir()) {
        Some(d) => PathBuf::from(d).join("eps-sched.sock"),
        None => {
            let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0);
            std::env::temp_dir().join(format!("eps-sched-{uid}.sock"))
        }
    }
}

/// A job as `eps submit` reads it (TOML; the trace's columns as keys).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Submission {
    name: String,
    param_bytes: u64,
    #[serde(default)]
    compute_ms_per_sample: f64,
    batch: u32,
    samples: u64,
    feedback_samples: u64,
    #[serde(default)]
    kill_after_feedback: bool,
    min_workers: u32,
    max_workers: u32,
    min_servers: u32,
    max_servers: u32,
}

/// Parses and checks a submission for a cluster of `slots`.
pub fn parse_submission(text: &str, slots: u32) -> Result<JobSpec, String> {
    let s: Submission = toml::from_str(text).map_err(|e| e.to_string().trim().replace('\n', " "))?;
    let j = JobSpec {
        name: s.name,
        submit_s: 0.0,
        param_bytes: s.param_bytes,
        compute_ms_per_sample: s.compute_ms_per_sample,
        batch: s.batch,
        samples: s.samples,
        feedback_samples: s.feedback_samples,
        kill_after_feedback: s.kill_after_feedback,
        workers: (s.min_workers, s.max_workers),
        servers: (s.min_servers, s.max_servers),
    };
    if j.name.trim().is_empty() || j.name.chars().any(char::is_whitespace) {
        return Err("`name` must be a word (no spaces)".into());
    }
    j.validate().map_err(|(f, why)| format!("`{f}` {why}"))?;
    if j.min_alloc().slots() > slots {
        return Err(format!("the job needs at least {} slots; the scheduler has {slots}", j.min_alloc().slots()));
    }
    // Checked as the job would start: a spec the roles accept.
    launcher::job_launch(&j, j.max_alloc(), 1)?;
    Ok(j)
}

/// What the listener and the driver share.
#[derive(Debug, Default)]
struct Inbox {
    new: Vec<JobSpec>,
    kills: Vec<String>,
    names: HashSet<String>,
    active: HashSet<String>,
    table: String,
}

struct Service(Arc<Mutex<Inbox>>);

fn inbox(m: &Mutex<Inbox>) -> std::sync::MutexGuard<'_, Inbox> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Source for Service {
    fn poll(&mut self, now_s: f64) -> (Vec<JobSpec>, Vec<String>) {
        let mut g = inbox(&self.0);
        let mut new = std::mem::take(&mut g.new);
        for j in &mut new {
            j.submit_s = now_s;
            g.active.insert(j.name.clone());
        }
        (new, std::mem::take(&mut g.kills))
    }

    fn exhausted(&self) -> bool {
        false
    }

    fn observe(&mut self, now_s: f64, jobs: &[JobState<'_>]) {
        let f = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
        let mut t = format!(
            "{:<16} {:<9} {:>7} {:>7} {:>21} {:>9} {:>9} {:>9} {:>9}  NODES\n",
            "JOB", "STATE", "WORKERS", "SERVERS", "SAMPLES", "SUBMIT s", "START s", "FEEDBK s", "END s"
        );
        let mut active = HashSet::new();
        for j in jobs {
            if matches!(j.state, "queued" | "running") {
                active.insert(j.name.to_string());
            }
            t += &format!(
                "{:<16} {:<9} {:>7} {:>7} {:>21} {:>9.1} {:>9} {:>9} {:>9}  {}\n",
                j.name,
                j.state,
                j.alloc.workers,
                j.alloc.servers,
                format!("{}/{}", j.samples.0, j.samples.1),
                j.record.submit_s,
                f(j.record.start_s),
                f(j.record.feedback_s),
                f(j.record.end_s),
                if j.nodes.is_empty() { "-" } else { &j.nodes }
            );
        }
        for j in jobs {
            if let Some(e) = j.error {
                t += &format!("{} failed: {e}\n", j.name);
            }
        }
        t += &format!("(at {now_s:.1} s)\n");
        let mut g = inbox(&self.0);
        // Jobs submitted since the poll are active too.
        active.extend(g.new.iter().map(|j| j.name.clone()));
        (g.table, g.active) = (t, active);
    }
}

/// Answers one request.
fn answer(req: &str, shared: &Mutex<Inbox>, slots: u32) -> Result<String, String> {
    let (cmd, body) = req.split_once('\n').unwrap_or((req, ""));
    let mut words = cmd.split_whitespace();
    match words.next() {
        Some("submit") => {
            let j = parse_submission(body, slots)?;
            let mut g = inbox(shared);
            if !g.names.insert(j.name.clone()) {
                return Err(format!("a job named {} was submitted already", j.name));
            }
            let name = j.name.clone();
            g.new.push(j);
            Ok(format!("submitted {name}\n"))
        }
        Some("jobs") => Ok(inbox(shared).table.clone()),
        Some("kill") => {
            let name = words.next().ok_or("kill needs a job name")?;
            let mut g = inbox(shared);
            if !g.active.contains(name) {
                return Err(format!("no queued or running job named {name} (see `eps jobs`)"));
            }
            g.kills.push(name.to_string());
            Ok(format!("killing {name}\n"))
        }
        _ => Err(format!("unknown request {cmd:?}")),
    }
}

fn handle(mut c: UnixStream, inbox: &Mutex<Inbox>, slots: u32) {
    let mut req = String::new();
    let r = (&mut c).take(MAX_REQUEST).read_to_string(&mut req);
    let reply = match r.map_err(|e| e.to_string()).and_then(|_| answer(&req, inbox, slots)) {
        Ok(text) => format!("ok\n{text}"),
        Err(e) => format!("error: {e}\n"),
    };
    let _ = c.write_all(reply.as_bytes());
}

/// Serves the scheduler on the Unix socket `path` until Ctrl-C (which stops
/// every job): takes `eps submit`, `eps jobs` and `eps kill` requests while
/// `policy` (named `policy_name`) runs the jobs on `cfg`'s cluster.
pub fn serve_on(path: &Path, cfg: &Config, policy: &mut dyn eps_sched::Policy, policy_name: &str) -> Result<(), String> {
    let slots = cfg.slots;
    if UnixStream::connect(path).is_ok() {
        return Err(format!("a scheduler already serves on {}", path.display()));
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("cannot restrict {}: {e}", path.display()))?;
    let shared = Arc::new(Mutex::new(Inbox::default()));
    {
        let shared = shared.clone();
        std::thread::spawn(move || {
            for c in listener.incoming().flatten() {
                handle(c, &shared, slots);
            }
        });
    }
    println!("EPS_SCHED={}", path.display());
    eps_proto::say!(
        "eps sched serve: {} slots, policy {policy_name}, on {} (eps submit JOB.toml, eps jobs, eps kill JOB; Ctrl-C stops every job)",
        slots,
        path.display()
    );
    let r = super::run(&mut Service(shared), cfg, policy, 0.0);
    let _ = std::fs::remove_file(path);
    match r {
        Err(e) if e.starts_with("interrupted") => {
            eps_proto::say!("eps sched serve: {e}");
            Ok(())
        }
        Err(e) => Err(e),
        Ok(_) => Ok(()),
    }
}

/// Sends one request to the scheduler at `socket` and prints its answer.
pub fn request(socket: Option<PathBuf>, cmd: &str, body: &str) -> Result<(), String> {
    let path = socket.unwrap_or_else(default_socket);
    let mut c = UnixStream::connect(&path)
        .map_err(|e| format!("no scheduler on {} ({e}); start one with `eps sched serve --slots N`", path.display()))?;
    c.write_all(format!("{cmd}\n{body}").as_bytes()).map_err(|e| e.to_string())?;
    c.shutdown(std::net::Shutdown::Write).map_err(|e| e.to_string())?;
    let mut reply = String::new();
    c.take(MAX_REQUEST).read_to_string(&mut reply).map_err(|e| e.to_string())?;
    match reply.strip_prefix("ok\n") {
        Some(text) => {
            print!("{text}");
            Ok(())
        }
        None => Err(reply.trim().strip_prefix("error: ").unwrap_or(reply.trim()).to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const JOB: &str = "name = \"j1\"\nparam_bytes = 512000\ncompute_ms_per_sample = 0.4\nbatch = 32\nsamples = 1000\n\
                       feedback_samples = 100\nmin_workers = 1\nmax_workers = 2\nmin_servers = 1\nmax_servers = 1\n";

    #[test]
    fn submissions_are_checked_and_requests_answered() {
        assert_eq!(parse_submission(JOB, 8).unwrap().workers, (1, 2));
        assert!(parse_submission(JOB, 1).unwrap_err().contains("at least 2 slots"));
        assert!(parse_submission(&JOB.replace("min_workers = 1", "min_workers = 3"), 8).unwrap_err().contains("min_workers"));
        assert!(parse_submission(&format!("{JOB}gpus = 1\n"), 8).unwrap_err().contains("gpus"));
        assert!(parse_submission(&JOB.replace("\"j1\"", "\"a b\""), 8).unwrap_err().contains("name"));
        let inbox = Mutex::new(Inbox::default());
        assert_eq!(answer(&format!("submit\n{JOB}"), &inbox, 8).unwrap(), "submitted j1\n");
        assert!(answer(&format!("submit\n{JOB}"), &inbox, 8).unwrap_err().contains("already"));
        assert!(answer("kill nope", &inbox, 8).unwrap_err().contains("no queued or running job"));
        let mut s = Service(Arc::new(inbox));
        let (new, _) = s.poll(3.0);
        assert_eq!((new.len(), new[0].submit_s), (1, 3.0));
        assert_eq!(answer("kill j1", &s.0, 8).unwrap(), "killing j1\n");
        assert_eq!(s.poll(4.0).1, vec!["j1".to_string()]);
        assert!(answer("frobnicate", &s.0, 8).unwrap_err().contains("unknown request"));
    }
}
