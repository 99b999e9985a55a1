//! Compiles kernels/eps_kernels.cu to PTX for sm_80 and sm_90 with nvcc when the
//! CUDA toolkit is installed (set `cfg(eps_cuda_ptx)`), or takes PTX made
//! elsewhere from `EPS_CUDA_PTX_DIR` (`eps_kernels_sm80.ptx`, `eps_kernels_sm90.ptx`,
//! e.g. by `eps bench gpu --emit-ptx DIR` with NVRTC), so that a GPU host needs
//! only the driver. Without either the crate embeds the source and compiles it
//! with NVRTC at run time. A build never fails because CUDA is absent.

use std::path::PathBuf;
use std::process::Command;

const ARCHS: [u32; 2] = [80, 90];

fn main() {
    let src = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../kernels/eps_kernels.cu");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo::rustc-check-cfg=cfg(eps_cuda_ptx)");
    println!("cargo:rerun-if-env-changed=EPS_CUDA_PTX_DIR");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    if let Some(dir) = std::env::var_os("EPS_CUDA_PTX_DIR").map(PathBuf::from) {
        for arch in ARCHS {
            let name = format!("eps_kernels_sm{arch}.ptx");
            println!("cargo:rerun-if-changed={}", dir.join(&name).display());
            if let Err(e) = std::fs::copy(dir.join(&name), out.join(&name)) {
                panic!("EPS_CUDA_PTX_DIR={}: {name}: {e}", dir.display());
            }
        }
        println!("cargo:rustc-cfg=eps_cuda_ptx");
        return;
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    if Command::new(&nvcc).arg("--version").output().is_err() {
        return; // No toolkit: NVRTC at run time.
    }
    for arch in ARCHS {
        let ptx = out.join(format!("eps_kernels_sm{arch}.ptx"));
        let r = Command::new(&nvcc)
            .args(["-ptx", &format!("-arch=sm_{arch}"), "-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false", "-o"])
            .arg(&ptx)
            .arg(&src)
            .status();
        if !matches!(r, Ok(s) if s.success()) {
            println!(
                "cargo:warning=nvcc could not compile {} for sm_{arch}; the kernels will be compiled by NVRTC at run time",
                src.display()
            );
            return;
        }
    }
    println!("cargo:rustc-cfg=eps_cuda_ptx");
}
