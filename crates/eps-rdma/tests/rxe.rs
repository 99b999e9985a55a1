//! Device discovery and selection on real RDMA devices: soft-RoCE in the VM that
//! `ci/softroce.sh` boots (where `EPS_RDMA_REQUIRE` is set, so a missing device
//! fails), or any machine with an RDMA NIC. Elsewhere it says plainly that it
//! skipped.

use eps_rdma::{DeviceChoice, GidKind, RdmaError, devices, select};

#[test]
fn devices_are_found_and_the_selection_is_explained() {
    let require = std::env::var_os("EPS_RDMA_REQUIRE").is_some();
    let devs = match devices() {
        Ok(d) if !d.is_empty() => d,
        Ok(_) | Err(_) if !require => {
            println!("skipped: no RDMA device here ({:?})", devices().err().map(|e| e.to_string()));
            return;
        }
        other => panic!("EPS_RDMA_REQUIRE is set but no device is usable: {other:?}"),
    };
    for d in &devs {
        println!("{}: {:?}", d.name, d.ports);
    }
    let s = select(&DeviceChoice::default()).expect("a device with an active port");
    println!("{s}");
    assert!(s.mtu >= 256, "active MTU {}", s.mtu);
    let port = devs.iter().find(|d| d.name == s.device).and_then(|d| d.ports.iter().find(|p| p.num == s.port)).unwrap();
    if port.link_layer == "Ethernet" {
        assert_eq!(s.gid.kind, GidKind::RoceV2, "RoCE v2 is detected when no index is named");
    }
    if let Ok(a) = std::env::var("EPS_RDMA_ADDR") {
        let want: std::net::Ipv4Addr = a.parse().expect("EPS_RDMA_ADDR is an IPv4 address");
        assert_eq!(s.gid.addr().to_ipv4_mapped(), Some(want), "the RoCE v2 GID of the device's address");
    }
    // Naming what was chosen gives the same; naming what does not exist says what does.
    let named = DeviceChoice { device: Some(s.device.clone()), port: Some(s.port), gid_index: Some(s.gid.index) };
    let again = select(&named).unwrap();
    assert_eq!((again.gid.clone(), again.how), (s.gid.clone(), ["named"; 3]));
    let e = select(&DeviceChoice { device: Some("no_such_dev".into()), ..Default::default() }).unwrap_err();
    assert!(matches!(e, RdmaError::UnknownDevice { .. }) && e.to_string().contains(&s.device), "{e}");
}

/// WRITE_WITH_IMM, READ and SEND/RECV between two queue pairs connected through
/// rdma_cm on the selected device (both ends on it, at `EPS_RDMA_ADDR`).
#[test]
fn a_queue_pair_writes_reads_and_sends() {
    use std::time::Duration;

    use eps_fabric::prelude::*;

    let mut opts = QpOptions::new(Secret::new("rxe-test").unwrap());
    opts.max_send_wr = 32;
    opts.max_recv_wr = 32;
    opts.max_sge = 2;
    let Some(Pair { device, a_pd, b_pd, a_cq, b_cq, a, b }) = pair(&opts, 256) else { return };
    assert_eq!(a.state(), QpState::ReadyToSend);
    let wait = |cq: &eps_rdma::RdmaCq, n: usize| {
        let mut got = Vec::new();
        let mut buf = [Completion::EMPTY; 8];
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while got.len() < n {
            let k = cq.poll(&mut buf).unwrap();
            got.extend_from_slice(&buf[..k]);
            assert!(std::time::Instant::now() < deadline, "timed out: {got:?}");
            if k == 0 {
                cq.wait(Duration::from_millis(5));
            }
        }
        got
    };
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut src = a_pd.alloc_mr(data.len(), Access::LOCAL_WRITE).unwrap();
    src.write_at(0, &data);
    let dst = b_pd.alloc_mr(data.len(), Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ).unwrap();
    // WRITE_WITH_IMM: the data lands, the receive completes with the immediate.
    b.post_recv(&RecvWr { wr_id: 11, sg: &[] }).unwrap();
    let wr = SendWr { wr_id: 1, op: SendOp::WriteImm(dst.remote(0), 0xDEAD_BEEF), sg: &[Sge::whole(&src)], signaled: true };
    a.post_send(&wr).unwrap();
    let c = wait(&a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status, c[0].opcode), (1, WcStatus::Success, WcOpcode::Write));
    let c = wait(&b_cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode, c[0].imm),
        (11, WcStatus::Success, WcOpcode::RecvWithImm, Some(0xDEAD_BEEF))
    );
    assert_eq!(c[0].qp_num, b.qp_num());
    let mut got = vec![0u8; data.len()];
    dst.read_at(0, &mut got);
    assert!(got == data, "the WRITE's bytes");
    // READ it back in two halves (scatter).
    let back = a_pd.alloc_mr(data.len(), Access::LOCAL_WRITE).unwrap();
    let half = (data.len() / 2) as u32;
    let sg = [Sge::new(&back, u64::from(half), half), Sge::new(&back, 0, half)];
    a.post_send(&SendWr { wr_id: 2, op: SendOp::Read(dst.remote(0)), sg: &sg, signaled: true }).unwrap();
    let c = wait(&a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status, c[0].opcode), (2, WcStatus::Success, WcOpcode::Read));
    let mut got = vec![0u8; data.len()];
    back.read_at(0, &mut got);
    assert!(got[half as usize..] == data[..half as usize] && got[..half as usize] == data[half as usize..], "READ scatter");
    // SEND into a posted RECV.
    let inbox = b_pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    b.post_recv(&RecvWr { wr_id: 12, sg: &[Sge::whole(&inbox)] }).unwrap();
    a.post_send(&SendWr { wr_id: 3, op: SendOp::Send, sg: &[Sge::new(&src, 0, 1000)], signaled: true }).unwrap();
    let c = wait(&b_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status, c[0].opcode, c[0].byte_len), (12, WcStatus::Success, WcOpcode::Recv, 1000));
    let mut got = vec![0u8; 1000];
    inbox.read_at(0, &mut got);
    assert!(got == data[..1000], "the SEND's bytes");
    assert_eq!(wait(&a_cq, 1)[0].wr_id, 3);
    // A bad rkey is a remote access error at the requester.
    let bad = RemoteAddr { addr: dst.addr(), rkey: dst.rkey() ^ 0x5A5A };
    a.post_send(&SendWr { wr_id: 4, op: SendOp::Write(bad), sg: &[Sge::new(&src, 0, 64)], signaled: true }).unwrap();
    let c = wait(&a_cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (4, WcStatus::RemoteAccess));
    println!("rdma data path on {device}: WRITE_WITH_IMM, READ, SEND/RECV and a bad rkey behave");
}

/// A long run of unsignaled small WRITEs (sent inline where the device allows)
/// on a shallow send queue: the provider signals some inside, so the queue never
/// stays full, and reports nothing but the one signaled completion at the end.
#[test]
fn unsignaled_runs_do_not_fill_the_send_queue() {
    use std::time::{Duration, Instant};

    use eps_fabric::prelude::*;

    let mut opts = QpOptions::new(Secret::new("rxe-test").unwrap());
    opts.max_send_wr = 16;
    opts.max_recv_wr = 4;
    let Some(Pair { a_pd, b_pd, a_cq, a, b: _b, .. }) = pair(&opts, 64) else { return };
    let n = 1000u64;
    let mut src = a_pd.alloc_mr(8 * n as usize, Access::LOCAL_WRITE).unwrap();
    for i in 0..n {
        src.write_at(8 * i as usize, &(i + 1).to_le_bytes());
    }
    let dst = b_pd.alloc_mr(8, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    let mut reported = Vec::new();
    let mut buf = [Completion::EMPTY; 16];
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in 0..n {
        let sg = [Sge::new(&src, 8 * i, 8)];
        let wr = SendWr { wr_id: i, op: SendOp::Write(dst.remote(0)), sg: &sg, signaled: i == n - 1 };
        loop {
            match a.post_send(&wr) {
                Ok(()) => break,
                Err(FabricError::QueueFull { .. }) => {
                    assert!(Instant::now() < deadline, "the send queue stayed full");
                    let k = a_cq.poll(&mut buf).unwrap();
                    reported.extend_from_slice(&buf[..k]);
                }
                Err(e) => panic!("{e}"),
            }
        }
    }
    while reported.is_empty() {
        assert!(Instant::now() < deadline, "the last WRITE never completed");
        let k = a_cq.poll(&mut buf).unwrap();
        reported.extend_from_slice(&buf[..k]);
    }
    std::thread::sleep(Duration::from_millis(20));
    let k = a_cq.poll(&mut buf).unwrap();
    reported.extend_from_slice(&buf[..k]);
    assert_eq!(reported.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(), [(n - 1, WcStatus::Success)]);
    let mut v = [0u8; 8];
    dst.read_at(0, &mut v);
    assert_eq!(u64::from_le_bytes(v), n, "RC order: the last WRITE's value");
    println!("rdma: {n} unsignaled WRITEs through a 16-deep send queue, one completion reported");
}

/// The registration cache: a dropped region comes back (zeroed) for the next
/// allocation of its length and access; while it is pooled its old rkey is
/// refused with a remote access error where the device can revoke remote access
/// in place, and where it cannot, nothing is pooled unless asked.
#[test]
fn dropped_regions_are_reused_and_unreachable_while_pooled() {
    use std::time::{Duration, Instant};

    use eps_fabric::prelude::*;
    use eps_rdma::RegCacheConfig;

    let opts = QpOptions::new(Secret::new("rxe-test").unwrap());
    let cfg = RegCacheConfig { unrevoked: true, ..RegCacheConfig::default() };
    let Some(Pair { device, a_pd, b_pd, a_cq, a, b: _b, .. }) = pair_with(&opts, 64, cfg) else { return };
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let len = 1 << 20;
    let mut target = b_pd.alloc_mr(len, all).unwrap();
    target.write_at(0, &[0xAB; 4096]);
    let (addr, stale) = (target.addr(), target.remote(0));
    let before = b_pd.reg_cache_stats();
    drop(target);
    let pooled = b_pd.reg_cache_stats();
    println!("rdma: registration cache after a drop: {pooled:?}");
    assert_eq!((pooled.pooled, pooled.pooled_bytes), (before.pooled + 1, before.pooled_bytes + len));
    if pooled.revocable == Some(true) {
        // A WRITE with the pooled region's rkey fails at the writer.
        let src = a_pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        a.post_send(&SendWr { wr_id: 5, op: SendOp::Write(stale), sg: &[Sge::whole(&src)], signaled: true }).unwrap();
        let mut buf = [Completion::EMPTY; 4];
        let deadline = Instant::now() + Duration::from_secs(20);
        let c = loop {
            let k = a_cq.poll(&mut buf).unwrap();
            if k > 0 {
                break buf[0];
            }
            assert!(Instant::now() < deadline, "the WRITE to a pooled region never completed");
            a_cq.wait(Duration::from_millis(5));
        };
        assert_eq!((c.wr_id, c.status), (5, WcStatus::RemoteAccess), "a pooled region is out of remote reach");
        println!("rdma: {device} revokes a pooled region's remote access: a WRITE with its old rkey failed");
    } else {
        println!("rdma: {device} cannot revoke remote access in place (ibv_rereg_mr failed): stale-rkey check skipped");
        let _ = (&a, &a_cq, stale);
        // The default configuration then pools nothing.
        let mr = a_pd.alloc_mr(len, all).unwrap();
        drop(mr);
        assert_eq!(a_pd.reg_cache_stats().pooled, 0, "regions whose access cannot be revoked are not pooled by default");
    }
    // The same length and access comes back from the pool, zeroed.
    let again = b_pd.alloc_mr(len, all).unwrap();
    let after = b_pd.reg_cache_stats();
    assert_eq!((again.addr(), after.hits, after.pooled), (addr, before.hits + 1, before.pooled));
    let mut head = vec![1u8; 4096];
    again.read_at(0, &mut head);
    assert!(head.iter().all(|&x| x == 0), "a region from the pool is zeroed");
    // Other access is a miss.
    let other = b_pd.alloc_mr(len, Access::LOCAL_WRITE).unwrap();
    assert_ne!(other.addr(), addr);
    assert_eq!(b_pd.reg_cache_stats().misses, after.misses + 1);
    println!("rdma: registration cache: {:?}", b_pd.reg_cache_stats());
}

/// Host pages exported as a dmabuf through /dev/udmabuf (a memfd's pages), standing
/// in for GPU memory: `register_dmabuf` runs for real. Devices without dmabuf
/// support (rxe) refuse it with an error, never a crash; devices with it take
/// WRITEs into it.
#[derive(Debug)]
struct Udmabuf {
    dmabuf: std::os::fd::OwnedFd,
    _memfd: std::os::fd::OwnedFd,
    map: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory read and written through copies only.
unsafe impl Send for Udmabuf {}
// SAFETY: as above.
unsafe impl Sync for Udmabuf {}

impl Drop for Udmabuf {
    fn drop(&mut self) {
        // SAFETY: mapped once in `new` with this length.
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

impl Udmabuf {
    /// `len` bytes (a multiple of the page size), or `None` without /dev/udmabuf.
    fn new(len: usize) -> Option<Self> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

        let dev = std::fs::OpenOptions::new().read(true).write(true).open("/dev/udmabuf").ok()?;
        // SAFETY: a valid C string; the fd is owned below.
        let memfd = unsafe { libc::memfd_create(c"eps-udmabuf".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(memfd >= 0, "memfd_create");
        // SAFETY: just created, owned from here on.
        let memfd = unsafe { OwnedFd::from_raw_fd(memfd) };
        // SAFETY: plain calls on our fd.
        unsafe {
            assert_eq!(libc::ftruncate(memfd.as_raw_fd(), len as libc::off_t), 0);
            assert_eq!(libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
        }
        #[repr(C)]
        struct Create {
            memfd: u32,
            flags: u32,
            offset: u64,
            size: u64,
        }
        const UDMABUF_CREATE: libc::c_ulong = 0x4018_7542; // _IOW('u', 0x42, struct udmabuf_create)
        let req =
            Create { memfd: memfd.as_raw_fd() as u32, flags: 1 /* UDMABUF_FLAGS_CLOEXEC */, offset: 0, size: len as u64 };
        // SAFETY: the request struct is laid out as the kernel's and outlives the call.
        let fd = unsafe { libc::ioctl(dev.as_raw_fd(), UDMABUF_CREATE, &req) };
        assert!(fd >= 0, "UDMABUF_CREATE: {}", std::io::Error::last_os_error());
        // SAFETY: the ioctl returned a new fd that we own.
        let dmabuf = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a shared mapping of the memfd, `len` bytes, checked below.
        let map = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, memfd.as_raw_fd(), 0)
        };
        assert_ne!(map, libc::MAP_FAILED);
        Some(Self { dmabuf, _memfd: memfd, map: map.cast(), len })
    }
}

impl eps_rdma::DeviceMemory for Udmabuf {
    fn dmabuf_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.dmabuf.as_raw_fd()
    }
    fn dmabuf_offset(&self) -> u64 {
        0
    }
    fn len(&self) -> usize {
        self.len
    }
    fn iova(&self) -> u64 {
        self.map as u64
    }
    fn read(&self, offset: usize, out: &mut [u8]) {
        // SAFETY: in bounds (the provider checks), the mapping lives as long as self.
        unsafe { std::ptr::copy_nonoverlapping(self.map.add(offset), out.as_mut_ptr(), out.len()) }
    }
    fn write(&self, offset: usize, data: &[u8]) {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.add(offset), data.len()) }
    }
}

#[test]
fn dmabuf_memory_registers_or_is_refused_cleanly() {
    use std::time::{Duration, Instant};

    use eps_fabric::prelude::*;

    let opts = QpOptions::new(Secret::new("rxe-test").unwrap());
    let Some(Pair { device, a_pd, b_pd, a_cq, a, b: _b, .. }) = pair(&opts, 64) else { return };
    let len = 1 << 16;
    let Some(mem) = Udmabuf::new(len) else {
        println!("\nrdma: dmabuf registration skipped: no /dev/udmabuf here to make a dmabuf from");
        return;
    };
    let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let mut target = match b_pd.register_dmabuf(Box::new(mem), all) {
        Ok(mr) => mr,
        Err(e) => {
            println!("\nrdma: {device} refuses dmabuf registration (no GPUDirect RDMA here): {e}");
            assert!(matches!(e, FabricError::Alloc { .. }), "a registration error: {e}");
            return;
        }
    };
    assert!(!target.is_host());
    target.write_at(0, &[0u8; 4096]);
    let mut src = a_pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    src.write_at(0, &[0x5A; 4096]);
    a.post_send(&SendWr { wr_id: 1, op: SendOp::Write(target.remote(512)), sg: &[Sge::whole(&src)], signaled: true }).unwrap();
    let mut buf = [Completion::EMPTY; 4];
    let deadline = Instant::now() + Duration::from_secs(20);
    while a_cq.poll(&mut buf).unwrap() == 0 {
        assert!(Instant::now() < deadline, "the WRITE never completed");
        a_cq.wait(Duration::from_millis(5));
    }
    assert_eq!(buf[0].status, WcStatus::Success);
    let mut got = vec![0u8; 4096];
    target.read_at(512, &mut got);
    assert!(got.iter().all(|&x| x == 0x5A), "the WRITE landed in the dmabuf's pages");
    println!("\nrdma: {device} registered a dmabuf and took a WRITE into it");
}

/// Two queue pairs connected through rdma_cm on the selected device (both ends on
/// it, at `EPS_RDMA_ADDR`), each side with its own PD and CQ; `None` (the test
/// skips, saying so) where there is no device, unless `EPS_RDMA_REQUIRE` is set.
struct Pair {
    device: String,
    a_pd: eps_rdma::RdmaPd,
    b_pd: eps_rdma::RdmaPd,
    a_cq: eps_rdma::RdmaCq,
    b_cq: eps_rdma::RdmaCq,
    a: eps_rdma::RdmaQp,
    b: eps_rdma::RdmaQp,
}

fn pair(opts: &eps_fabric::QpOptions, cq_depth: u32) -> Option<Pair> {
    pair_with(opts, cq_depth, eps_rdma::RegCacheConfig::default())
}

/// As [`pair`], the second PD's registration cache configured by `cache`.
fn pair_with(opts: &eps_fabric::QpOptions, cq_depth: u32, cache: eps_rdma::RegCacheConfig) -> Option<Pair> {
    use eps_fabric::prelude::*;

    let require = std::env::var_os("EPS_RDMA_REQUIRE").is_some();
    let (Ok(addr), Ok(sel)) = (std::env::var("EPS_RDMA_ADDR"), select(&DeviceChoice::default())) else {
        assert!(!require, "EPS_RDMA_REQUIRE is set but EPS_RDMA_ADDR or a device is missing");
        println!("skipped: no RDMA device or no EPS_RDMA_ADDR here");
        return None;
    };
    let dev = eps_rdma::RdmaDevice::open(&sel.device).expect("open the device through rdma_cm");
    let (a_pd, b_pd) = (dev.alloc_pd_with(eps_rdma::RegCacheConfig::default()).unwrap(), dev.alloc_pd_with(cache).unwrap());
    let (a_cq, b_cq) = (a_pd.create_cq(cq_depth).unwrap(), b_pd.create_cq(cq_depth).unwrap());
    let l = b_pd.listen(format!("{addr}:0").parse().unwrap(), opts).expect("listen");
    let at = l.local_addr();
    assert_ne!(at.port(), 0, "the listener reports its port");
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&b_cq, &b_cq, std::time::Duration::from_secs(20)).expect("accept"));
        let a = a_pd.connect(at, &a_cq, &a_cq, opts).expect("connect");
        (a, h.join().unwrap())
    });
    Some(Pair { device: sel.device, a_pd, b_pd, a_cq, b_cq, a, b })
}
