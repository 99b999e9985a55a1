//! Every code block of the README, ARCHITECTURE.md and the guide is tested, as the comment
//! before it says (`<!-- docs-test: MODE -->`; a block without one fails):
//!
//! - `run`: a `sh` block runs in bash (`set -e`, in a fresh directory, the
//!   release `eps` first on PATH, `$EPS_REPO` the repository), a `python`
//!   one in python3; each must succeed.
//! - `flags`: a `sh` block of commands with placeholders (a synopsis, or
//!   commands for a cluster this machine is not): every `eps ...` line (or
//!   `cargo run --release -- ...`) names a subcommand that exists and only
//!   flags its `--help` lists; every `bash FILE` names a file that exists.
//! - `spec`: a `toml` block is (part of) a job spec that `eps` accepts (its
//!   preset expanded, as `eps train --spec` reads it).
//! - `compile`: a `c` block compiles against `include/eps.h` (placeholders
//!   it calls are declared), a `python` one parses (it needs a running job).
//! - `text`: a `text` block is a drawing, not code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fenced block: where, its language, its mode, its text.
struct Block {
    at: String,
    lang: String,
    mode: String,
    text: String,
}

fn blocks() -> Vec<Block> {
    let files = common::cli::doc_pages();
    let mut out = Vec::new();
    for f in files {
        let md = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = md.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let Some(lang) = lines[i].strip_prefix("```") else {
                i += 1;
                continue;
            };
            let start = i;
            let end = (i + 1..lines.len()).find(|&j| lines[j].starts_with("```")).unwrap_or(lines.len());
            let marker = lines[..start].iter().rev().find(|l| !l.trim().is_empty()).copied().unwrap_or("");
            let mode =
                marker.trim().strip_prefix("<!-- docs-test:").and_then(|m| m.strip_suffix("-->")).map(str::trim).unwrap_or("");
            let at = format!("{}:{}", f.strip_prefix(root()).unwrap().display(), start + 1);
            out.push(Block { at, lang: lang.trim().to_string(), mode: mode.to_string(), text: lines[start + 1..end].join("\n") });
            i = end + 1;
        }
    }
    out
}

fn eps_bin() -> PathBuf {
    std::env::var_os("EPS_BIN").map(PathBuf::from).unwrap_or_else(|| root().join("target/release/eps"))
}

/// The `--help` of `BIN ARGS`, cached.
fn help<'a>(cache: &'a mut BTreeMap<String, Option<String>>, bin: &Path, args: &[&str]) -> Option<&'a str> {
    cache
        .entry(format!("{} {}", bin.display(), args.join(" ")))
        .or_insert_with(|| {
            let o = Command::new(bin).args(args).arg("--help").output().ok()?;
            o.status.success().then(|| String::from_utf8_lossy(&o.stdout).to_string())
        })
        .as_deref()
}

/// Checks one command line of a `flags` block; `Err` says what is wrong.
fn check_line(line: &str, cache: &mut BTreeMap<String, Option<String>>) -> Result<bool, String> {
    let line = line.split(" #").next().unwrap_or(line).trim();
    let words: Vec<&str> = line.split_whitespace().skip_while(|w| w.contains('=') && !w.starts_with('-')).collect();
    if let ["bash", file, ..] = words[..] {
        return if root().join(file).exists() { Ok(true) } else { Err(format!("{file} does not exist")) };
    }
    let eps = eps_bin();
    // The simulator, as the test command builds it (not with features).
    let sim = eps.with_file_name("eps-sim");
    let (bin, rest): (&Path, &[&str]) = match words[..] {
        [w, ..] if w == "eps" || w.ends_with("/eps") => (&eps, &words[1..]),
        ["cargo", "run", "--release", "--", ..] => (&eps, &words[4..]),
        ["cargo", "run", "--release", "-p", "eps-sim", "--", ..] => (&sim, &words[6..]),
        _ => return Ok(false),
    };
    // The subcommand: the leading words `eps WORDS --help` accepts.
    let mut sub: Vec<&str> = Vec::new();
    for w in rest.iter().take_while(|w| w.chars().all(|c| c.is_ascii_lowercase())) {
        let mut next = sub.clone();
        next.push(w);
        if help(cache, bin, &next).is_none() {
            break;
        }
        sub = next;
    }
    let text =
        help(cache, bin, &sub).ok_or_else(|| format!("`{} {}` is not a command", bin.display(), sub.join(" ")))?.to_string();
    for w in rest {
        let flag = w.trim_start_matches('[').split(['=', ']']).next().unwrap_or("");
        if flag.starts_with("--") && flag.len() > 2 && !text.contains(&format!("{flag} ")) && !text.contains(&format!("{flag}\n"))
        {
            return Err(format!("`eps {}` has no flag {flag}", sub.join(" ")));
        }
    }
    Ok(true)
}

/// A spec fragment with what it lacks of a whole job spec around it.
fn whole_spec(fragment: &str) -> String {
    let base_job = "[job]\nworkers = 1\nservers = 1\nsteps = 10\n";
    let base_model = "[model]\ntensors = [{ name = \"w\", elements = 64 }]\n";
    let mut s = String::new();
    if !fragment.contains("[job]") {
        s += base_job;
    }
    if !fragment.contains("[model]") {
        s += base_model;
    }
    s + fragment
}

fn run_block(b: &Block) -> Result<(), String> {
    let dir = common::cli::tmp("docs", &b.at.replace(['/', ':', '.'], "-"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = format!("{}:{}", eps_bin().parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = match b.lang.as_str() {
        "sh" => {
            let mut c = Command::new("bash");
            c.args(["-ec", &b.text]);
            c
        }
        "python" => {
            let mut c = Command::new("python3");
            c.args(["-c", &b.text]);
            c
        }
        l => return Err(format!("cannot run a {l} block")),
    };
    let o = cmd.current_dir(&dir).env("PATH", path).env("EPS_REPO", root()).output().map_err(|e| e.to_string())?;
    std::fs::remove_dir_all(&dir).ok();
    if o.status.success() {
        Ok(())
    } else {
        Err(format!("failed: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    }
}

fn compile_block(b: &Block) -> Result<(), String> {
    match b.lang.as_str() {
        "c" => {
            let dir = common::cli::tmp("docs-c", &b.at.replace(['/', ':', '.'], "-"));
            std::fs::create_dir_all(&dir).unwrap();
            let src = dir.join("block.c");
            let wrapped = format!(
                "#include <stdint.h>\n#include \"eps.h\"\n#define DIM 8\n\
                 void compute_gradient(const float *params, float *grads, uint64_t begin, uint64_t end);\n\
                 void block(void) {{\n{}\n}}\n",
                b.text
            );
            std::fs::write(&src, wrapped).unwrap();
            let o = Command::new("cc")
                .args(["-std=c11", "-Wall", "-Werror", "-fsyntax-only", "-I"])
                .arg(root().join("include"))
                .arg(&src)
                .output()
                .map_err(|e| format!("cc: {e}"))?;
            std::fs::remove_dir_all(&dir).ok();
            if o.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&o.stderr).to_string()) }
        }
        "python" => {
            let o = Command::new("python3")
                .args(["-c", "import ast, sys; ast.parse(sys.stdin.read())"])
                .stdin(std::process::Stdio::piped())
                .spawn();
            let mut child = o.map_err(|e| e.to_string())?;
            use std::io::Write as _;
            child.stdin.take().unwrap().write_all(b.text.as_bytes()).unwrap();
            let o = child.wait_with_output().unwrap();
            if o.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&o.stderr).to_string()) }
        }
        l => Err(format!("cannot compile a {l} block")),
    }
}

#[test]
fn every_code_block_of_the_readme_and_the_guide_is_tested() {
    let mut cache = BTreeMap::new();
    let mut failed = Vec::new();
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for b in blocks() {
        let r = match (b.mode.as_str(), b.lang.as_str()) {
            ("run", _) => run_block(&b),
            ("compile", _) => compile_block(&b),
            ("spec", "toml") => eps_cluster::jobspec::parse(&whole_spec(&b.text)).map(|_| ()).map_err(|e| e.to_string()),
            ("flags", "sh") => {
                let mut checked = 0;
                let mut r = Ok(());
                for line in b.text.lines() {
                    match check_line(line, &mut cache) {
                        Ok(c) => checked += usize::from(c),
                        Err(e) => r = Err(format!("{line}: {e}")),
                    }
                }
                r.and_then(|()| if checked > 0 { Ok(()) } else { Err("no eps command in it".into()) })
            }
            // A drawing (ARCHITECTURE.md's map of the crates): nothing to run.
            ("text", "text") => Ok(()),
            ("", _) => Err("no <!-- docs-test: MODE --> before it".into()),
            (m, l) => Err(format!("mode {m:?} for a {l} block")),
        };
        *count.entry(format!("{} {}", b.mode, b.lang)).or_default() += 1;
        if let Err(e) = r {
            failed.push(format!("{} ({} {}): {e}", b.at, b.mode, b.lang));
        }
    }
    println!("code blocks tested, by mode and language: {count:?}");
    assert!(failed.is_empty(), "{} block(s):\n{}", failed.len(), failed.join("\n"));
    assert!(count.values().sum::<usize>() >= 20, "{count:?}: the parser missed blocks");
}

#[test]
fn a_flags_check_catches_what_does_not_exist() {
    let mut cache = BTreeMap::new();
    assert_eq!(check_line("eps train --steps 10 --json   # a comment --nope", &mut cache), Ok(true));
    assert_eq!(check_line("EPS_JOB_SECRET=x eps sim grid [--loads 2,4]", &mut cache), Ok(true));
    assert!(check_line("eps train --stepz 10", &mut cache).unwrap_err().contains("--stepz"));
    assert!(check_line("eps sim grid --nope", &mut cache).unwrap_err().contains("--nope"));
    assert!(check_line("bash ci/nothing.sh", &mut cache).is_err());
    assert_eq!(check_line("sbatch job.sbatch", &mut cache), Ok(false));
    assert!(Path::new(&whole_spec("[[model.tables]]\nname = \"t\"\ndim = 4\n")).to_str().is_some());
    assert!(eps_proto::JobSpec::from_toml(&whole_spec("[[model.tables]]\nname = \"t\"\ndim = 4\n")).is_ok());
}

/// The subcommands `--help` lists under "Commands:".
fn subcommands(help: &str) -> Vec<String> {
    let list = help.split("Commands:\n").nth(1).unwrap_or("");
    let lines = list.lines().take_while(|l| !l.trim().is_empty());
    lines.filter_map(|l| l.split_whitespace().next()).filter(|c| *c != "help").map(str::to_string).collect()
}

/// The CLI chapter names every command and subcommand `eps --help` lists,
/// so a command added is a command documented.
#[test]
fn the_cli_chapter_names_every_command() {
    let cli = std::fs::read_to_string(root().join("docs/src/cli.md")).unwrap();
    let mut cache = BTreeMap::new();
    let eps = eps_bin();
    let top = subcommands(help(&mut cache, &eps, &[]).expect("eps --help"));
    assert!(top.len() > 15 && top.contains(&"train".to_string()), "{top:?}");
    let mut missing = Vec::new();
    for c in &top {
        let subs = subcommands(help(&mut cache, &eps, &[c]).unwrap_or_default());
        let names: Vec<String> =
            if subs.is_empty() { vec![format!("eps {c}")] } else { subs.iter().map(|s| format!("eps {c} {s}")).collect() };
        missing.extend(names.into_iter().filter(|n| !cli.split_whitespace().collect::<Vec<_>>().join(" ").contains(n.as_str())));
    }
    assert!(missing.is_empty(), "docs/src/cli.md does not name {missing:?}");
}
