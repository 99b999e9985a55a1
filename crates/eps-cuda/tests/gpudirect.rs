//! GPUDirect RDMA: GPU memory registered with an RDMA NIC through its dmabuf
//! takes a peer's WRITE. Needs a GPU that exports dmabufs and an RDMA device that
//! imports them; elsewhere it says plainly that it skipped.
#![cfg(feature = "rdma")]

use std::sync::Arc;

use eps_fabric::prelude::*;

#[test]
fn gpu_memory_takes_a_write_through_the_nic() {
    let gpu = match eps_cuda::Gpu::open(0) {
        Ok(g) => Arc::new(g),
        Err(e) => {
            println!("skipped: no usable GPU here ({e})");
            return;
        }
    };
    let (Ok(addr), Ok(sel)) = (std::env::var("EPS_RDMA_ADDR"), eps_rdma::select(&eps_rdma::DeviceChoice::default())) else {
        println!("skipped: no RDMA device (or no EPS_RDMA_ADDR) here");
        return;
    };
    let dev = eps_rdma::RdmaDevice::open(&sel.device).unwrap();
    let (a_pd, b_pd) = (dev.alloc_pd().unwrap(), dev.alloc_pd().unwrap());
    let buf = match eps_cuda::dmabuf::GpuBuffer::new(gpu, 1 << 20) {
        Ok(b) => b,
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let target = match eps_cuda::dmabuf::register(&b_pd, buf, all) {
        Ok(mr) => mr,
        Err(e) => {
            println!("skipped: {} does not import dmabufs: {e}", sel.device);
            return;
        }
    };
    let opts = QpOptions::new(Secret::new("gpudirect").unwrap());
    let (a_cq, b_cq) = (a_pd.create_cq(16).unwrap(), b_pd.create_cq(16).unwrap());
    let l = b_pd.listen(format!("{addr}:0").parse().unwrap(), &opts).unwrap();
    let at = l.local_addr();
    let (a, _b) = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&b_cq, &b_cq, std::time::Duration::from_secs(20)).unwrap());
        (a_pd.connect(at, &a_cq, &a_cq, &opts).unwrap(), h.join().unwrap())
    });
    let mut src = a_pd.alloc_mr(65536, Access::LOCAL_WRITE).unwrap();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 13 + 1) as u8).collect();
    src.write_at(0, &data);
    a.post_send(&SendWr { wr_id: 1, op: SendOp::Write(target.remote(4096)), sg: &[Sge::whole(&src)], signaled: true }).unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while a_cq.poll(&mut wc).unwrap() == 0 {
        assert!(std::time::Instant::now() < deadline, "the WRITE never completed");
    }
    assert_eq!(wc[0].status, WcStatus::Success);
    let mut got = vec![0u8; data.len()];
    target.read_at(4096, &mut got);
    assert_eq!(got, data, "the WRITE landed in GPU memory");
    println!("gpudirect: {} wrote 64 KiB into GPU memory through {}", sel.device, sel.device);
}
