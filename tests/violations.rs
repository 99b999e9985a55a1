//! Workers that break the protocol: the server reports the violation, closes that
//! worker's connection (the worker sees its transfers fail), and keeps serving the
//! other workers to the end of the job.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{run_server, secret, start_control, worker_config};
use eps_control::ControlClient;
use eps_fabric::prelude::*;
use eps_proto::control::{ControlMsg, Role};
use eps_proto::hello::Hello;
use eps_proto::imm::{Imm, ImmKind};
use eps_worker::{Worker, WorkerError};

const SPEC: &str = r#"
[job]
workers = 2
servers = 1
steps = 20
consistency = "asp"
shard_bytes = 8192
[model]
tensors = [{ name = "w", elements = 5000 }]
[optimizer]
kind = "sgd"
lr = 0.01
"#;

#[derive(Clone, Copy, Debug)]
enum Bad {
    WrongSize,
    StaleIteration,
    UnknownShard,
    ServerOnlyMessage,
}

/// A hand-made worker that joins, says hello, then sends one bad message.
/// Returns whether its connection was cut.
fn misbehave(control: SocketAddr, bad: Bad) -> bool {
    let mut ctl = ControlClient::connect(control, &secret(), Duration::from_secs(10)).unwrap();
    let ControlMsg::Registered { rank, .. } =
        ctl.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap()
    else {
        panic!("not registered")
    };
    let ControlMsg::Map(map) = ctl.call(&ControlMsg::GetMap { worker: rank, adopted: 0, min_epoch: 0, iteration: 0 }).unwrap()
    else {
        panic!("no map")
    };
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let cq = pd.create_cq(256).unwrap();
    let params = pd.alloc_mr(1 << 20, Access::ALL).unwrap();
    let mut buf = pd.alloc_mr(1 << 20, Access::ALL).unwrap();
    buf.write_at(0, &Hello { rank, pull_rkey: params.rkey(), pull_addr: params.addr() }.encode());
    let mut o = QpOptions::new(secret());
    o.max_msg_bytes = 1 << 20;
    let qp = pd.connect(map.server_addr(0).unwrap().parse().unwrap(), &cq, &cq, &o).unwrap();
    for _ in 0..32 {
        qp.post_recv(&RecvWr { wr_id: 0, sg: &[] }).unwrap();
    }
    qp.post_send(&SendWr { wr_id: 1, op: SendOp::Send, sg: &[Sge::new(&buf, 0, 16)], signaled: true }).unwrap();
    let (slot, rkey) = map.routes[0].owner.landing[rank as usize];
    let (shard, seq, len) = match bad {
        Bad::WrongSize => (0, 0, 100),
        Bad::StaleIteration => (0, 7, 8192),
        Bad::UnknownShard => (999, 0, 8192),
        Bad::ServerOnlyMessage => (0, 0, 0),
    };
    let kind = if matches!(bad, Bad::ServerOnlyMessage) { ImmKind::Credit } else { ImmKind::Push };
    let imm = Imm { kind, shard, seq }.encode();
    let sg = [Sge::new(&buf, 0, len)];
    let sg: &[Sge<'_, SoftMr>] = if len == 0 { &[] } else { &sg };
    qp.post_send(&SendWr { wr_id: 2, op: SendOp::WriteImm(RemoteAddr { addr: slot, rkey }, imm), sg, signaled: true }).unwrap();
    // The server cuts the connection: our QP goes to the error state.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wc = [Completion::EMPTY; 16];
    let cut = loop {
        let _ = cq.poll(&mut wc);
        if qp.state() == QpState::Error {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    ctl.call(&ControlMsg::Finished { role: Role::Worker, rank }).unwrap();
    cut
}

fn run(bad: Bad) {
    let (_, control) = start_control(SPEC);
    std::thread::scope(|s| {
        let server = s.spawn(move || run_server(control));
        let good = s.spawn(move || -> Result<u64, WorkerError> {
            let mut w = Worker::join(&worker_config(control))?;
            assert!(matches!(w.tensor("nope"), Err(WorkerError::UnknownTensor(_))));
            assert!(matches!(w.write_grads(&[0.0; 3]), Err(WorkerError::Length { .. })));
            for _ in 0..20 {
                w.push_pull()?;
            }
            let it = w.iteration();
            w.finish()?;
            Ok(it)
        });
        let cut = s.spawn(move || misbehave(control, bad)).join().unwrap();
        assert!(cut, "{bad:?}: the server must close the offending worker's connection");
        assert_eq!(good.join().unwrap().expect("the well-behaved worker finishes"), 20, "{bad:?}");
        let summary = server.join().unwrap();
        assert_eq!(summary.violations, 1, "{bad:?}");
        // ASP pulls are RDMA READs by the workers: the server wrote none.
        assert_eq!(summary.pulls, 0, "{bad:?}");
        assert!(summary.updates >= 20, "{bad:?}: {} updates", summary.updates);
    });
}

#[test]
fn wrong_size_push() {
    run(Bad::WrongSize);
}

#[test]
fn stale_iteration() {
    run(Bad::StaleIteration);
}

#[test]
fn unknown_shard() {
    run(Bad::UnknownShard);
}

#[test]
fn server_only_message() {
    run(Bad::ServerOnlyMessage);
}
