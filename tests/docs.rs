//! The README and the guide (`docs/`, an mdBook): the README stays short,
//! every chapter is in the book's summary, every relative link and anchor
//! in them (and in ARCHITECTURE.md) reaches a file or heading that exists,
//! and `mdbook build docs` succeeds.

use std::path::{Path, PathBuf};

mod common;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn pages() -> Vec<PathBuf> {
    common::cli::doc_pages()
}

/// The text of `md` outside fenced code blocks and code spans.
fn prose(md: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            // Code spans hold example syntax, not links.
            let mut in_code = false;
            for part in line.split('`') {
                if !in_code {
                    out.push_str(part);
                }
                in_code = !in_code;
            }
            out.push('\n');
        }
    }
    out
}

/// The targets of the inline links and images in `md`: `[text](target)`.
fn links(md: &str) -> Vec<String> {
    let text = prose(md);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        match after.find(')') {
            Some(end) => {
                out.push(after[..end].split_whitespace().next().unwrap_or("").to_string());
                rest = &after[end..];
            }
            None => break,
        }
    }
    out
}

/// A heading's anchor as mdBook and GitHub make it: lower case, spaces to
/// hyphens, punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(md: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(slug(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_reaches_something() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let md = std::fs::read_to_string(&page).unwrap();
        for target in links(&md) {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let path = if file.is_empty() { page.clone() } else { page.parent().unwrap().join(file) };
            if !path.exists() {
                broken.push(format!("{}: {target}: no such file", page.display()));
                continue;
            }
            // A file here that git ignores (a generated chart) is not in a fresh clone.
            let ignored =
                std::process::Command::new("git").arg("-C").arg(root()).args(["check-ignore", "-q"]).arg(&path).status();
            if ignored.is_ok_and(|s| s.success()) {
                broken.push(format!("{}: {target}: ignored by git, so not in a fresh clone", page.display()));
                continue;
            }
            if !anchor.is_empty() && !anchors(&std::fs::read_to_string(&path).unwrap_or_default()).iter().any(|a| a == anchor) {
                broken.push(format!("{}: {target}: no such heading", page.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 30, "only {checked} links checked: the parser missed them");
}

#[test]
fn the_readme_is_short_and_the_summary_lists_every_chapter() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let n = readme.lines().count();
    assert!(n <= 200, "README.md has {n} lines: the guide is where detail goes");
    let summary = std::fs::read_to_string(root().join("docs/src/SUMMARY.md")).unwrap();
    let listed = links(&summary);
    for page in pages().iter().skip(2) {
        let name = page.file_name().unwrap().to_str().unwrap();
        if name != "SUMMARY.md" {
            assert!(listed.iter().any(|l| l == name), "docs/src/{name} is not in SUMMARY.md");
        }
    }
    // The parser finds what it must, and nothing in code.
    assert_eq!(links("[a](x.md) `[b](y.md)` ![c](z.png)\n```\n[d](w.md)\n```\n"), ["x.md", "z.png"]);
    assert_eq!(slug("Sparse embedding tables: `eps` (v2)"), "sparse-embedding-tables-eps-v2");
}

/// `mdbook` on PATH, or where the test command installs it.
fn mdbook() -> Option<PathBuf> {
    let cached = Path::new("/var/cache/eps-tools/mdbook/bin/mdbook");
    if cached.exists() {
        return Some(cached.to_path_buf());
    }
    std::process::Command::new("mdbook").arg("--version").output().ok().filter(|o| o.status.success()).map(|_| "mdbook".into())
}

#[test]
fn the_guide_builds() {
    let Some(mdbook) = mdbook() else {
        eps_etcd::testing::skip("the_guide_builds", "mdbook is not installed (ci/test.sh installs it)");
        return;
    };
    let out = std::env::temp_dir().join(format!("eps-book-{}", std::process::id()));
    let o = std::process::Command::new(mdbook)
        .args(["build", "--dest-dir", out.to_str().unwrap()])
        .arg(root().join("docs"))
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr).to_string() + &String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "mdbook build docs: {log}");
    assert!(!log.contains("WARN") && !log.contains("ERROR"), "mdbook build docs: {log}");
    for page in ["index.html", "sparse-tables.html", "troubleshooting.html", "internals.html"] {
        assert!(out.join(page).exists(), "{page} was not built: {log}");
    }
    std::fs::remove_dir_all(&out).ok();
}
