//! `eps train` run as a process group of its own, its stderr lines
//! collected as they come, with processes of it killed or stopped by pid.

use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cli::{Lines, eps};

/// A run of `eps train` in a process group of its own, its stderr lines
/// collected as they come.
pub struct Run {
    pub child: Child,
    pub lines: Lines,
}

impl Run {
    pub fn start(args: &[&str]) -> Self {
        let mut child = eps()
            .args(["train", "--json", "--progress-every", "5"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let lines = Lines::default();
        lines.collect(child.stderr.take().unwrap(), "");
        Self { child, lines }
    }

    /// Waits for a progress line at `step` or later.
    pub fn wait_step(&mut self, step: u64) {
        self.lines.until(&format!("step {step}"), |l| {
            let at = l.strip_prefix("step").and_then(|r| r.trim_start().split('/').next()?.parse::<u64>().ok());
            at.is_some_and(|s| s >= step)
        });
    }

    /// `eps status` of the running job (the control plane's address from its
    /// first line, the job secret from its environment).
    pub fn status(&self) -> String {
        let text = self.lines.text();
        // "eps control: job "NAME" on ADDR: waiting for ..."
        let addr = text
            .lines()
            .find_map(|l| l.strip_prefix("eps control: job ")?.split(" on ").nth(1)?.split_whitespace().next())
            .unwrap_or_else(|| panic!("no control-plane address yet:\n{text}"))
            .trim_end_matches(':')
            .to_string();
        let env = std::fs::read(format!("/proc/{}/environ", self.role_pid("control"))).unwrap();
        let secret = env
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"EPS_JOB_SECRET="))
            .map(|v| String::from_utf8_lossy(v).to_string())
            .expect("the control plane's job secret");
        let o = eps().args(["status", "--control", &addr]).env("EPS_JOB_SECRET", secret).output().unwrap();
        assert!(o.status.success(), "eps status: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    }

    /// The pid of the child process whose command line has `role` (`control`,
    /// `server`) as its first argument.
    pub fn role_pid(&self, role: &str) -> u32 {
        self.role_pids(role)[0]
    }

    /// Every child process whose command line has `role` as its first argument.
    pub fn role_pids(&self, role: &str) -> Vec<u32> {
        let mut found = Vec::new();
        let me = self.child.id().to_string();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
            let ppid = stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1));
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
            if ppid == Some(me.as_str()) && args.get(1) == Some(&role.as_bytes()) {
                found.push(e.file_name().to_str().unwrap().parse().unwrap());
            }
        }
        assert!(!found.is_empty(), "no {role} process under {me}");
        found.sort_unstable();
        found
    }

    /// Waits for a stderr line containing `text`.
    pub fn wait_line(&mut self, text: &str) -> String {
        self.lines.line(text)
    }

    /// A stderr line containing `text`: one seen already, or the next.
    pub fn seen_line(&mut self, text: &str) -> String {
        match self.lines.text().lines().find(|l| l.contains(text)) {
            Some(l) => l.to_string(),
            None => self.wait_line(text),
        }
    }

    /// The pid of server rank `rank` (from its "registered" line).
    pub fn server_pid(&mut self, rank: u32) -> u32 {
        let l = self.seen_line(&format!("eps server {rank}: registered (pid "));
        let rest = l.rsplit("(pid ").next().unwrap();
        rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len())].parse().unwrap()
    }

    /// Waits for the end: success, stdout and every stderr line.
    pub fn finish(mut self) -> (bool, String, String) {
        // Bounded: a run that hangs fails with its log.
        let deadline = Instant::now() + Duration::from_secs(200);
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                self.lines.rest(Duration::from_millis(200));
                panic!("the run did not end in time; its log:\n{}", self.lines.text());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut out = String::new();
        std::io::Read::read_to_string(self.child.stdout.as_mut().unwrap(), &mut out).unwrap();
        let ok = status.success();
        self.lines.rest(Duration::from_secs(5));
        (ok, out, self.lines.text())
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", self.child.id())]).stderr(Stdio::null()).status();
        let _ = self.child.wait();
    }
}

pub fn kill(pid: u32) {
    assert!(Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap().success());
}

/// SIGKILLs `pid` if it is still there: whether it was.
pub fn kill_if_alive(pid: u32) -> bool {
    Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status().unwrap().success()
}

/// SIGKILLs `pids` at once (one `kill` command), so that no failover runs
/// between their deaths: two `kill` commands in a row can be far apart on a
/// loaded machine.
pub fn kill_together(pids: &[u32]) {
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    assert!(Command::new("kill").arg("-KILL").args(&pids).status().unwrap().success());
}
