//! The C ABI from C: `tests/c/bad_input.c` is compiled with the system's C
//! compiler against `include/eps.h` and this build's `libeps.so` (under
//! AddressSanitizer when the compiler has it) and run.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>`, where cargo put `libeps.so` for this test run.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>");
    assert!(dir.join("libeps.so").exists(), "libeps.so is not in {}: build eps-capi first", dir.display());
    dir.to_path_buf()
}

/// Whether `cc` can build and run an AddressSanitizer program here.
fn asan_works(dir: &Path) -> bool {
    let src = dir.join("asan_probe.c");
    let exe = dir.join("asan_probe");
    std::fs::write(&src, "int main(void) { return 0; }\n").expect("write probe");
    let built = Command::new("cc").args(["-fsanitize=address", "-o"]).arg(&exe).arg(&src).status().is_ok_and(|s| s.success());
    built && Command::new(&exe).status().is_ok_and(|s| s.success())
}

/// Compiles `src` against the header and library; returns the executable.
pub fn build_c(src: &Path, name: &str) -> (PathBuf, bool) {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c-api");
    std::fs::create_dir_all(&out).expect("tmp dir");
    let lib = lib_dir();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include");
    let asan = asan_works(&out);
    let exe = out.join(name);
    let mut cc = Command::new("cc");
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g"]);
    if asan {
        cc.arg("-fsanitize=address");
    }
    cc.arg("-I").arg(&include).arg(src).arg("-o").arg(&exe).arg("-L").arg(&lib).arg("-leps");
    cc.arg(format!("-Wl,-rpath,{}", lib.display()));
    let st = cc.status().expect("run cc (a C compiler is needed for the C ABI tests: apt-get install gcc)");
    assert!(st.success(), "compiling {} failed", src.display());
    (exe, asan)
}

#[test]
fn bad_input_never_crashes_and_every_call_says_why() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/bad_input.c");
    let (exe, asan) = build_c(&src, "bad_input");
    println!("bad_input.c built {}", if asan { "with AddressSanitizer" } else { "without AddressSanitizer (cc lacks it)" });
    let out = Command::new(&exe)
        // Leaks are not what this test looks for (the library keeps closed
        // handles' small allocations on purpose, and hosted threads run on).
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .env_remove("EPS_CONTROL")
        .env_remove("EPS_JOB_SECRET")
        .output()
        .expect("run bad_input");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "bad_input failed:\n{text}");
    assert!(text.contains("every check passed"));
}
