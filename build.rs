//! Build script of the `eps` package: records the target and profile for `eps --version`.
//! (CUDA kernels in `kernels/` are compiled by the eps-cuda crate's own build.)

fn main() {
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown-target".into());
    let profile = std::env::var("PROFILE").unwrap_or_else(|_| "unknown-profile".into());
    println!("cargo:rustc-env=EPS_BUILD_TARGET={target}");
    println!("cargo:rustc-env=EPS_BUILD_PROFILE={profile}");
    println!("cargo:rerun-if-changed=build.rs");
}
