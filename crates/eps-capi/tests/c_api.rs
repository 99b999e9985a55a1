//! The C ABI from C: `tests/c/bad_input.c` is compiled with the system's C
//! compiler against `include/eps.h` and this build's `libeps.so` (under
//! AddressSanitizer and UBSan when the compiler has them; under `CI=true` it
//! must) and run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>`, with `libeps.so` and the `eps` binary built fresh for
/// this test run (cargo does not rebuild a cdylib-only library for its
/// integration tests, so they build it here, once per test binary).
fn lib_dir() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test executable path");
            let dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf();
            let release = dir.file_name().is_some_and(|n| n == "release");
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut c = Command::new(cargo);
            c.args(["build", "--quiet", "-p", "eps-capi", "-p", "eps", "--lib", "--bin", "eps"]);
            if release {
                c.arg("--release");
            }
            c.current_dir(env!("CARGO_MANIFEST_DIR"));
            let st = c.status().expect("run cargo build");
            assert!(st.success(), "cargo build of libeps and eps failed");
            assert!(dir.join("libeps.so").exists(), "libeps.so is not in {}", dir.display());
            dir
        })
        .clone()
}

/// The sanitizers every C test is built with: AddressSanitizer and
/// UndefinedBehaviorSanitizer (any report ends the program with a failure).
const SANITIZE: [&str; 2] = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"];

/// Whether `cc` can build and run a program under [`SANITIZE`] here. Under
/// `CI=true` it must: the C tests then never run without them.
fn sanitizers_work(dir: &Path) -> bool {
    // One probe per test process: the tests run in parallel and would build
    // and run each other's half-written files.
    let id = std::process::id();
    let src = dir.join(format!("asan_probe_{id}.c"));
    let exe = dir.join(format!("asan_probe_{id}"));
    std::fs::write(&src, "int main(void) { return 0; }\n").expect("write probe");
    let built = Command::new("cc").args(SANITIZE).arg("-o").arg(&exe).arg(&src).status().is_ok_and(|s| s.success());
    let works = built && Command::new(&exe).status().is_ok_and(|s| s.success());
    assert!(
        works || std::env::var("CI").as_deref() != Ok("true"),
        "CI=true: cc cannot build with AddressSanitizer and UBSan here (install gcc with libasan and libubsan)"
    );
    works
}

/// Compiles `src` against the header and library; returns the executable.
pub fn build_c(src: &Path, name: &str) -> (PathBuf, bool) {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c-api");
    std::fs::create_dir_all(&out).expect("tmp dir");
    let lib = lib_dir();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include");
    let asan = sanitizers_work(&out);
    let exe = out.join(name);
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g"]);
    if asan {
        cc.args(SANITIZE);
    }
    cc.arg("-I")
        .arg(&include)
        .arg("-I")
        .arg(src.parent().expect("a directory"))
        .arg(src)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib)
        .arg("-leps")
        .arg("-lm")
        .arg("-lpthread");
    cc.arg(format!("-Wl,-rpath,{}", lib.display()));
    let st = cc.status().expect("run cc (a C compiler is needed for the C ABI tests: apt-get install gcc)");
    assert!(st.success(), "compiling {} failed", src.display());
    (exe, asan)
}

/// Builds `tests/c/NAME.c` and runs it alone (no job in the environment):
/// it must exit 0 saying "every check passed".
fn run_c_test(name: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let (exe, sanitized) = build_c(&src, name);
    println!(
        "{name}.c built {}",
        if sanitized { "with AddressSanitizer and UBSan" } else { "without sanitizers (cc lacks them)" }
    );
    let out = Command::new(&exe)
        // Leaks are not what these tests look for (the library keeps closed
        // handles' small allocations on purpose, and hosted threads run on).
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .env_remove("EPS_CONTROL")
        .env_remove("EPS_JOB_SECRET")
        .env_remove("EPS_JOB_SECRET_FILE")
        .output()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success() && text.contains("every check passed"), "{name} failed:\n{text}");
}

#[test]
fn bad_input_never_crashes_and_every_call_says_why() {
    run_c_test("bad_input");
}

/// Counts from outside that add up past 2^64 are refused, and a wait with
/// timeout 0 ends after the worker's timeout when a peer stalls.
#[test]
fn sums_are_checked_and_every_wait_ends() {
    run_c_test("bounded");
}

/// Every exported call, made by a hostile caller with generated arguments
/// (`tests/c/hostile.h`), answers with a status and a message, never
/// crashes or hangs, while a well-behaved worker beside it stays exact.
#[test]
fn a_hostile_caller_gets_a_status_for_every_call_and_a_good_worker_stays_exact() {
    run_c_test("hostile");
}

#[test]
fn caller_owned_buffers_are_registered_in_place() {
    run_c_test("borrowed");
}

/// `examples/c/train.c`, two processes against `eps up`, which stops by
/// itself once they finished.
#[test]
fn the_c_example_trains_against_eps_up() {
    use std::io::{BufRead, BufReader};
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/c/train.c");
    let (exe, _) = build_c(&src, "train");
    let eps = lib_dir().join("eps");
    assert!(eps.exists(), "the eps binary is not in {}: build the workspace first", eps.display());
    let mut up = Command::new(&eps)
        .args([
            "up",
            "--workers",
            "2",
            "--servers",
            "2",
            "--steps",
            "150",
            "--lr",
            "0.05",
            "--transport",
            "soft",
            "--aggregator",
            "cpu",
        ])
        .env_remove("EPS_JOB_SECRET")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start eps up");
    let mut lines = BufReader::new(up.stdout.take().expect("piped")).lines();
    let control = lines.next().expect("a first line").expect("utf-8");
    let secret_file = lines.next().expect("a second line").expect("utf-8");
    let control = control.strip_prefix("EPS_CONTROL=").unwrap_or_else(|| panic!("first line {control:?}")).to_string();
    let secret_file =
        secret_file.strip_prefix("EPS_JOB_SECRET_FILE=").unwrap_or_else(|| panic!("second line {secret_file:?}")).to_string();
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&secret_file).expect("the secret file").permissions());
    assert_eq!(mode & 0o777, 0o600, "the secret file is readable by its user only");
    let workers: Vec<_> = (0..2)
        .map(|_| {
            Command::new(&exe)
                .env("EPS_CONTROL", &control)
                .env("EPS_JOB_SECRET_FILE", &secret_file)
                .env_remove("EPS_JOB_SECRET")
                .env("ASAN_OPTIONS", "detect_leaks=0")
                .output_async()
        })
        .collect();
    let outs: Vec<_> = workers.into_iter().map(|c| c.wait_with_output().expect("worker output")).collect();
    let mut accuracy = None;
    for o in &outs {
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        println!("{text}");
        assert!(o.status.success(), "a worker failed:\n{text}");
        if let Some(a) = text.lines().find_map(|l| l.strip_prefix("accuracy=")) {
            accuracy = Some(a.trim().parse::<f64>().expect("a number"));
        }
    }
    let accuracy = accuracy.expect("rank 0 prints the accuracy");
    assert!(accuracy > 0.9, "held-out accuracy {accuracy}");
    // The job has finished: eps up stops its servers and exits by itself.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(s) = up.try_wait().expect("wait eps up") {
            break s;
        }
        if std::time::Instant::now() > deadline {
            let _ = up.kill();
            panic!("eps up did not exit after the job finished");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "eps up exited with {status}");
    assert!(!Path::new(&secret_file).exists(), "eps up removes its directory, secret included");
}

trait SpawnPiped {
    fn output_async(&mut self) -> std::process::Child;
}

impl SpawnPiped for Command {
    fn output_async(&mut self) -> std::process::Child {
        self.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("start a worker")
    }
}
