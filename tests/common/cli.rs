//! Helpers for tests that run the `eps` binary as a user does: a small job,
//! temporary paths, and the fields of the JSON line a run ends with.

use std::path::PathBuf;
use std::process::Command;

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

/// The `eps` binary under test.
pub fn eps() -> Command {
    Command::new(env!("CARGO_BIN_EXE_eps"))
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
