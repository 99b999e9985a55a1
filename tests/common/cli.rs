//! Helpers for tests that run the `eps` binary as a user does: a small job,
//! temporary paths, and the fields of the JSON line a run ends with.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A small BSP job of the built-in task (2 workers, 2 servers, 300 steps).
pub const SMALL_JOB: &str = r#"
[job]
workers = 2
servers = 2
steps = 300
batch = 32
shard_bytes = 65536
[model]
preset = "synthetic"
buckets = 16384
[optimizer]
kind = "adam"
lr = 0.01
[lr_schedule]
warmup_steps = 10
decay = "cosine"
min_lr = 0.001
"#;

/// A path in the temporary directory for this test process, removed first.
pub fn tmp(tag: &str, name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("eps-{tag}-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// [`SMALL_JOB`] written to a file.
pub fn spec_file(tag: &str, name: &str) -> PathBuf {
    let p = tmp(tag, name).with_extension("toml");
    std::fs::write(&p, SMALL_JOB).unwrap();
    p
}

/// The `eps` binary under test: `EPS_BIN` when set (CI sets a release build:
/// the jobs these tests run then take the time they take in use), else the
/// one built with the tests.
pub fn eps() -> Command {
    Command::new(std::env::var("EPS_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_eps").to_string()))
}

/// Starts `cmd` with its stdout and stderr collected as [`Lines`].
pub fn spawn_collected(cmd: &mut Command) -> (Child, Lines) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let lines = Lines::default();
    lines.collect(child.stdout.take().unwrap(), "");
    lines.collect(child.stderr.take().unwrap(), "");
    (child, lines)
}

/// The address an `eps control` started with its stdout piped says it
/// listens on (its first line, `EPS_CONTROL_READY addr=...`).
pub fn control_ready(control: &mut Child) -> String {
    let mut line = String::new();
    BufReader::new(control.stdout.take().unwrap()).read_line(&mut line).unwrap();
    line.trim().strip_prefix("EPS_CONTROL_READY addr=").unwrap_or_else(|| panic!("{line:?}")).to_string()
}

/// Field `key` of the JSON object on the last line of `stdout`.
pub fn json_field(stdout: &str, key: &str) -> String {
    let last = stdout.lines().last().unwrap_or_default().to_string();
    let pat = format!("\"{key}\":");
    let at = last.find(&pat).unwrap_or_else(|| panic!("{key} missing: {stdout}")) + pat.len();
    let rest = &last[at..];
    if let Some(text) = rest.strip_prefix('"') {
        return text[..text.find('"').unwrap()].to_string();
    }
    rest[..rest.find([',', '}']).unwrap()].to_string()
}

/// Lines that child processes print, collected as they come (a thread per
/// stream), and every line taken so far.
pub struct Lines {
    tx: mpsc::Sender<String>,
    rx: mpsc::Receiver<String>,
    /// Every line taken so far, in the order taken.
    pub seen: Vec<String>,
}

impl Default for Lines {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel();
        Self { tx, rx, seen: Vec::new() }
    }
}

impl Lines {
    /// Collects `r`'s lines, each prefixed with `tag`.
    pub fn collect(&self, r: impl Read + Send + 'static, tag: &str) {
        let (tx, tag) = (self.tx.clone(), tag.to_string());
        std::thread::spawn(move || {
            for l in BufReader::new(r).lines().map_while(Result::ok) {
                let _ = tx.send(format!("{tag}{l}"));
            }
        });
    }

    /// Takes lines until one for which `done` holds (at most 120 s); returns
    /// it. Panics naming `what`, with every line so far, if none comes.
    pub fn until(&mut self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let l = self.rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).unwrap_or_else(|_| {
                panic!("no {what} in time:\n{}", self.text());
            });
            self.seen.push(l.clone());
            if done(&l) {
                return l;
            }
        }
    }

    /// Takes a line containing `text`.
    pub fn line(&mut self, text: &str) -> String {
        self.until(&format!("line with {text:?}"), |l| l.contains(text))
    }

    /// Takes lines until one containing each of `texts` has come, in any order
    /// (lines of different processes reach the collector in no fixed order),
    /// counting those already taken after the `since`-th.
    pub fn all_of(&mut self, since: usize, texts: &[&str]) {
        let mut missing: Vec<&str> =
            texts.iter().copied().filter(|t| !self.seen[since.min(self.seen.len())..].iter().any(|l| l.contains(t))).collect();
        while let Some(&t) = missing.first() {
            let l = self.until(&format!("line with {t:?}"), |l| missing.iter().any(|m| l.contains(m)));
            missing.retain(|m| !l.contains(m));
        }
    }

    /// Takes what is left, until nothing comes for `quiet`.
    pub fn rest(&mut self, quiet: Duration) {
        while let Ok(l) = self.rx.recv_timeout(quiet) {
            self.seen.push(l);
        }
    }

    /// Every line taken so far.
    pub fn text(&self) -> String {
        self.seen.join("\n")
    }
}

/// The markdown a user reads: the README, ARCHITECTURE.md and the guide's
/// chapters (`docs/src`).
pub fn doc_pages() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut chapters: Vec<PathBuf> = std::fs::read_dir(root.join("docs/src"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    chapters.sort();
    [vec![root.join("README.md"), root.join("ARCHITECTURE.md")], chapters].concat()
}
