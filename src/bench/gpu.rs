//! `eps bench gpu`: the GPU kernels' GB/s as a fraction of the device-to-device
//! copy rate of the same run (`eps_cuda::bench`).

/// Runs the measurement and prints a table (and a JSON line with `json`).
#[cfg(feature = "cuda")]
pub fn run(size: u64, reps: usize, json: bool) -> Result<(), String> {
    let gpu = std::sync::Arc::new(eps_cuda::Gpu::open(0).map_err(|e| format!("eps bench gpu: {e}"))?);
    let elements = (size / 4).max(1024) as usize;
    eps_proto::say!("eps bench gpu: {}; buffers of {} f32 values, {reps} repetitions", gpu.info(), elements);
    let r = eps_cuda::bench::run(&gpu, elements, reps).map_err(|e| format!("eps bench gpu: {e}"))?;
    println!("{:<14} {:>10} {:>10}", "kernel", "GB/s", "x copy");
    println!("{:<14} {:>10.1} {:>10.3}", "d2d copy", r.copy_gbps, 1.0);
    println!("{:<14} {:>10.1} {:>10.3}", "sum 8 x f32", r.sum8_gbps, r.sum8_ratio());
    println!("{:<14} {:>10.1} {:>10.3}", "adam (fused)", r.adam_gbps, r.adam_ratio());
    println!("{:<14} {:>10.1} {:>10.3}", "shard update", r.update_gbps, r.update_ratio());
    if json {
        let j = super::Json::new()
            .str("device", &gpu.info().name)
            .int("elements", r.elements as u64)
            .int("reps", r.reps as u64)
            .num("copy_gbytes_per_s", r.copy_gbps)
            .num("sum8_gbytes_per_s", r.sum8_gbps)
            .num("adam_gbytes_per_s", r.adam_gbps)
            .num("sum8_ratio", r.sum8_ratio())
            .num("adam_ratio", r.adam_ratio())
            .num("update_gbytes_per_s", r.update_gbps)
            .num("update_ratio", r.update_ratio())
            .finish();
        println!("{j}");
    }
    Ok(())
}

/// Without the `cuda` feature: says how to get it.
#[cfg(not(feature = "cuda"))]
pub fn run(_size: u64, _reps: usize, _json: bool) -> Result<(), String> {
    Err("this eps was built without CUDA support: rebuild it with `cargo build --release --features cuda`".into())
}

/// Writes `eps_kernels_sm80.ptx` and `eps_kernels_sm90.ptx` into `dir`.
#[cfg(feature = "cuda")]
pub fn emit_ptx(dir: &std::path::Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for (arch, name) in [("sm_80", "eps_kernels_sm80.ptx"), ("sm_90", "eps_kernels_sm90.ptx")] {
        let ptx = eps_cuda::ptx_for(arch).map_err(|e| e.to_string())?;
        std::fs::write(dir.join(name), ptx).map_err(|e| format!("{}: {e}", dir.join(name).display()))?;
        eps_proto::say!("eps bench gpu: wrote {}", dir.join(name).display());
    }
    Ok(())
}

/// Without the `cuda` feature: says how to get it.
#[cfg(not(feature = "cuda"))]
pub fn emit_ptx(_dir: &std::path::Path) -> Result<(), String> {
    run(0, 0, false)
}
