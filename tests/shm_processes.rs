//! The shm provider between real processes, one of them killed with SIGKILL in
//! the middle of 16 MiB WRITEs: the survivor's requests fail and flush (no
//! hang), and a responder whose requester died goes on and ends cleanly, its
//! memory whole (a dead peer's mappings of it are gone with the peer, and its
//! own mappings of the peer's memory stay valid until it lets them go).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use eps_fabric::prelude::*;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;

const SECRET: &str = "shm-processes-test-secret";
const SIZE: u64 = 16 << 20;

/// Pids whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        let ppid: u32 =
            stat.rsplit(')').next().and_then(|r| r.split_whitespace().nth(1)).and_then(|x| x.parse().ok()).unwrap_or(0);
        if ppid == pid {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_responder_killed_mid_transfer_fails_the_requests_and_nothing_hangs() {
    let mut peer = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["bench", "fabric-peer", "--op", "write", "--size", &SIZE.to_string(), "--depth", "8", "--transport", "shm"])
        .env("EPS_JOB_SECRET", SECRET)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(peer.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.first(), Some(&"EPS_PEER_READY"), "{line}");
    let at: SocketAddr = f[1].parse().unwrap();
    let remote = RemoteAddr { addr: f[2].parse().unwrap(), rkey: f[3].parse().unwrap() };

    let pd = eps_fabric::shm::ShmDevice::open().unwrap().alloc_pd();
    let cq = pd.create_cq(64).unwrap();
    let mut o = QpOptions::new(Secret::new(SECRET).unwrap());
    o.max_send_wr = 9;
    let qp = pd.connect(at, &cq, &cq, &o).unwrap();
    let src = pd.alloc_mr(SIZE as usize, Access::ALL).unwrap();
    let sg = [Sge::whole(&src)];
    let (mut posted, mut done, mut ok, mut failed) = (0u64, 0u64, 0u64, 0u64);
    let mut wc = [Completion::EMPTY; 16];
    let started = Instant::now();
    let mut killed = false;
    let deadline = started + Duration::from_secs(30);
    while !(killed && done == posted) {
        assert!(Instant::now() < deadline, "requests still outstanding: {posted} posted, {done} done");
        if !killed && started.elapsed() > Duration::from_millis(300) {
            kill(Pid::from_raw(peer.id() as i32), Signal::SIGKILL).unwrap();
            killed = true;
        }
        while !killed && posted - done < 8 {
            qp.post_send(&SendWr { wr_id: posted, op: SendOp::Write(remote), sg: &sg, signaled: true }).unwrap();
            posted += 1;
        }
        let n = cq.poll(&mut wc).unwrap();
        for c in &wc[..n] {
            assert_eq!(c.wr_id, done, "in order");
            done += 1;
            if c.status.is_ok() {
                assert_eq!(failed, 0, "no success after a failure");
                ok += 1;
            } else {
                assert!(matches!(c.status, WcStatus::RetryExceeded | WcStatus::WrFlush), "{c:?}");
                failed += 1;
            }
        }
    }
    peer.wait().unwrap();
    assert!(ok > 0, "some WRITEs landed before the kill");
    assert!(failed > 0, "the requests outstanding at the kill failed");
    assert_eq!(qp.state(), QpState::Error);
}

#[test]
fn a_responder_whose_requester_is_killed_goes_on_and_ends_cleanly() {
    // Orphans come to this process, so the responder's exit status can be read.
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let mut bench = Command::new(env!("CARGO_BIN_EXE_eps"))
        .args(["bench", "fabric", "--transport", "shm", "--op", "write", "--size", "16MiB", "--depth", "8"])
        .args(["--iters", "100000000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let responder = loop {
        if let Some(&p) = children_of(bench.id()).first() {
            break p;
        }
        assert!(Instant::now() < deadline, "the bench never started its peer");
        std::thread::sleep(Duration::from_millis(10));
    };
    // Let the WRITEs run, then kill the requester in the middle of them.
    std::thread::sleep(Duration::from_millis(1500));
    bench.kill().unwrap();
    bench.wait().unwrap();
    let pid = Pid::from_raw(responder as i32);
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)).unwrap() {
            WaitStatus::StillAlive => {
                assert!(Instant::now() < deadline + Duration::from_secs(10), "the responder did not end");
                std::thread::sleep(Duration::from_millis(10));
            }
            WaitStatus::Exited(_, code) => {
                assert_eq!(code, 0, "the responder ends cleanly when its peer is gone");
                break;
            }
            other => panic!("the responder died: {other:?}"),
        }
    }
}
