//! A peer that rewrites a sparse request after the server checked it changes
//! nothing: the server copies each request out of the landing region when it
//! lands, checks the copy and acts on the copy alone. (It once parsed the
//! region again when the iteration was applied: garbage written there
//! between the check and the use stopped the server.)

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::Duration;

use common::{run_server, secret, start_control, step, worker_config};
use eps_control::ControlClient;
use eps_fabric::prelude::*;
use eps_proto::control::ControlMsg;
use eps_worker::Worker;

const SPEC: &str = r#"
[job]
workers = 2
servers = 1
steps = 3
shard_bytes = 8192
seed = 3
[model]
tensors = [{ name = "w", elements = 1000 }]
[[model.tables]]
name = "cats"
dim = 3
key_limit = 300
init = "zeros"
optimizer = "sgd"
lr = 0.5
max_keys = 16
[optimizer]
kind = "sgd"
lr = 0.1
"#;

/// Writes 256 bytes of 0xFF over worker `rank`'s landing region of table 0
/// (its push request: header and keys), as any peer with the job secret can.
fn overwrite_push_region(control: SocketAddr, rank: u32) {
    let mut ctl = ControlClient::connect(control, &secret(), Duration::from_secs(10)).unwrap();
    let ControlMsg::Map(map) = ctl.call(&ControlMsg::GetMap { worker: 0, adopted: 0, min_epoch: 0, iteration: 0 }).unwrap()
    else {
        panic!("no map")
    };
    let (addr, rkey) = map.tables[0].landing[rank as usize];
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let cq = pd.create_cq(16).unwrap();
    let mut buf = pd.alloc_mr(4096, Access::ALL).unwrap();
    buf.write_at(0, &[0xFF; 256]);
    let qp = pd.connect(map.server_addr(0).unwrap().parse().unwrap(), &cq, &cq, &QpOptions::new(secret())).unwrap();
    let wr = SendWr { wr_id: 1, op: SendOp::Write(RemoteAddr { addr, rkey }), sg: &[Sge::new(&buf, 0, 256)], signaled: true };
    qp.post_send(&wr).unwrap();
    let mut wc = [Completion::EMPTY; 4];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cq.poll(&mut wc).unwrap_or(0) == 0 {
        assert!(std::time::Instant::now() < deadline, "the WRITE did not complete");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(wc[0].status, WcStatus::Success, "the WRITE landed");
}

/// Three iterations of both workers pushing rows of keys 0..8, the first
/// one's push before the other's; in iteration 1, once the first's push has
/// landed (and been checked) and before the other's (which completes the
/// iteration), its region is overwritten when `hostile`. Returns every
/// key's row at the end and the server's summary.
fn run(hostile: bool) -> (Vec<f32>, eps_server::ServerSummary) {
    let (_, control) = start_control(SPEC);
    let server = std::thread::spawn(move || run_server(control));
    let (pushed_tx, pushed_rx) = mpsc::channel::<(u64, u32)>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let keys: Vec<u64> = (0..8).collect();
    let rows = std::thread::scope(|s| {
        let keys = &keys;
        let w0 = s.spawn(move || {
            let mut w = Worker::join(&worker_config(control)).unwrap();
            let n = w.layout().total as usize;
            let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
            for t in 0..3u64 {
                let grads: Vec<f32> = (0..keys.len() * 3).map(|i| (i as f32 + t as f32) * 0.25).collect();
                w.sparse_push(0, keys, &grads).unwrap();
                pushed_tx.send((t, w.rank())).unwrap();
                step(&mut w, &mut p, &mut g);
            }
            let mut rows = vec![0f32; keys.len() * 3];
            w.sparse_pull(0, keys, &mut rows).unwrap();
            w.finish().unwrap();
            rows
        });
        let w1 = s.spawn(move || {
            let mut w = Worker::join(&worker_config(control)).unwrap();
            let n = w.layout().total as usize;
            let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
            for t in 0..3u64 {
                go_rx.recv().unwrap();
                let grads: Vec<f32> = (0..keys.len() * 3).map(|i| 1.0 - (i as f32) * 0.5 - t as f32).collect();
                w.sparse_push(0, keys, &grads).unwrap();
                step(&mut w, &mut p, &mut g);
            }
            w.finish().unwrap();
        });
        for t in 0..3u64 {
            let (at, rank) = pushed_rx.recv().unwrap();
            assert_eq!(at, t);
            if hostile && t == 1 {
                // The first worker's push has landed and been checked by
                // now; the iteration waits for the other's.
                std::thread::sleep(Duration::from_millis(300));
                overwrite_push_region(control, rank);
            }
            go_tx.send(()).unwrap();
        }
        w1.join().unwrap();
        w0.join().unwrap()
    });
    (rows, server.join().unwrap())
}

#[test]
fn a_request_rewritten_after_its_check_changes_nothing() {
    let (honest, _) = run(false);
    let (attacked, summary) = run(true);
    assert_eq!(
        attacked.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        honest.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "the rows after a rewritten request differ from the honest run's"
    );
    assert!(honest.iter().any(|&x| x != 0.0), "the rows were stepped");
    assert_eq!(summary.violations, 0, "the request was checked before it was rewritten");
}
