//! The service over real connections: restarts, bounds, long polls, the end.

use super::*;
use crate::ControlClient;
use crate::store::FileStore;
use eps_proto::control::{Order, Role, ShardEndpoint};

const SPEC: &str = "[job]\nworkers = 1\nservers = 2\n[model]\ntensors = [{ name = \"dense.weight\", elements = 256 }, { name = \"dense.bias\", elements = 4 }, { name = \"sparse.embedding\", elements = 4096 }]\n";

/// A control plane of `SPEC` on a thread, with its in-memory store and
/// the secret `name`.
fn serve(name: &str) -> (SocketAddr, Secret) {
    let spec = JobSpec::from_toml(SPEC).unwrap();
    let secret = Secret::new(name).unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let svc = ControlService::bind(any, &spec, SPEC, secret.clone(), Box::new(crate::store::MemStore::default())).unwrap();
    let addr = svc.local_addr();
    std::thread::spawn(move || svc.run());
    (addr, secret)
}

fn status(addr: SocketAddr, secret: &Secret) -> String {
    let mut c = ControlClient::connect(addr, secret, Duration::from_secs(5)).unwrap();
    match c.call(&ControlMsg::Status).unwrap() {
        ControlMsg::StatusReport { text } => text,
        m => panic!("{m:?}"),
    }
}

#[test]
fn membership_survives_a_restart_and_the_job_is_bounded() {
    let dir = std::env::temp_dir().join(format!("eps-control-replay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let spec = JobSpec::from_toml(SPEC).unwrap();
    let secret = Secret::new("replay").unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    {
        let svc = ControlService::bind(any, &spec, SPEC, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap();
        let addr = svc.local_addr();
        std::thread::spawn(move || svc.run());
        let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
        let r = c.call(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        assert!(matches!(r, ControlMsg::Registered { rank: 0, .. }));
        let r = c.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
        assert!(matches!(r, ControlMsg::Registered { rank: 0, .. }));
        // Static membership: a second worker is refused with a reason.
        let e = c.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("every worker rank this job admitted is taken: 1 registered and running [0]"), "{e}");
        assert!(e.contains("may admit no more ranks (job.max_workers = 1)"), "{e}");
        assert!(status(addr, &secret).contains("servers: 1/2 registered"));
    }
    // A new control plane on the same state directory replays the log.
    let svc = ControlService::bind(any, &spec, SPEC, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap();
    let addr = svc.local_addr();
    std::thread::spawn(move || svc.run());
    let text = status(addr, &secret);
    assert!(text.contains("servers: 1/2 registered") && text.contains("workers: 1/1 registered"), "{text}");
    let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
    let r = c.call(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
    assert!(matches!(r, ControlMsg::Registered { rank: 1, .. }), "ranks continue after the replay");
    // Another job's spec cannot take over this state directory.
    let other = SPEC.replace("servers = 2", "servers = 3");
    let spec2 = JobSpec::from_toml(&other).unwrap();
    let e = ControlService::bind(any, &spec2, &other, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap_err();
    assert!(e.to_string().contains("another spec"), "{e}");
    // A wrong secret gets nothing.
    let bad = Secret::new("wrong").unwrap();
    assert!(ControlClient::connect(addr, &bad, Duration::from_secs(5)).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

/// A server its peers cannot reach while it still polls (a cut link):
/// lost once two peers say so; one peer alone, a repeated report, or the
/// word of a server that was lost itself is not enough.
#[test]
fn a_server_two_peers_cannot_reach_is_lost_and_one_peer_is_not_enough() {
    let text = "[job]\nworkers = 2\nservers = 3\nreplicas = 2\n[model]\ntensors = [{ name = \"dense.weight\", elements = 256 }, { name = \"dense.bias\", elements = 4 }, { name = \"sparse.embedding\", elements = 4096 }]\n";
    let spec = JobSpec::from_toml(text).unwrap();
    let layout = spec.layout().unwrap();
    let dir = std::env::temp_dir().join(format!("eps-control-unreachable-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let secret = Secret::new("unreachable").unwrap();
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let svc = ControlService::bind(any, &spec, text, secret.clone(), Box::new(FileStore::open(&dir).unwrap())).unwrap();
    let addr = svc.local_addr();
    std::thread::spawn(move || svc.run());
    let mut c = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
    let ep = |id: u32, r: u32| eps_proto::control::ShardEndpoint {
        shard: id,
        owner: r,
        landing: vec![(0, 0)],
        published_addr: 0,
        published_rkey: 0,
    };
    for r in 0..3u32 {
        c.call(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        let shards = layout.shards_of(r).map(|s| ep(s.id, r)).collect();
        c.call(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
    for _ in 0..2 {
        c.call(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
    }
    let lost = |r: u32| status(addr, &secret).contains(&format!("  server {r}: lost,"));
    let report = |c: &mut ControlClient, rank: u32, by: Role, by_rank: u32| {
        assert!(matches!(c.call(&ControlMsg::Unreachable { rank, by, by_rank }).unwrap(), ControlMsg::Ok));
    };
    // One worker, twice; and server 2 itself about server 1.
    report(&mut c, 2, Role::Worker, 0);
    report(&mut c, 2, Role::Worker, 0);
    report(&mut c, 1, Role::Server, 2);
    assert!(!lost(2) && !lost(1), "{}", status(addr, &secret));
    // A second peer: server 2 is lost, and its own report goes with it.
    report(&mut c, 2, Role::Worker, 1);
    assert!(lost(2), "{}", status(addr, &secret));
    report(&mut c, 1, Role::Worker, 0);
    assert!(!lost(1), "server 2's report still counted:\n{}", status(addr, &secret));
    // A lost server's word is void.
    report(&mut c, 0, Role::Server, 2);
    report(&mut c, 0, Role::Worker, 1);
    assert!(!lost(0), "{}", status(addr, &secret));
    std::fs::remove_dir_all(&dir).ok();
}

/// A peer that sends far ahead of its answers, and reads none of them, is
/// read and answered no further than a frame ahead (it waits, as TCP
/// makes it), and the others are served.
#[test]
fn a_peer_that_sends_ahead_is_held_back_not_buffered() {
    use std::io::Write as _;
    let (addr, secret) = serve("ahead");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    crate::conn::auth_client(&mut s, &secret).unwrap();
    // A long poll (its answer waits), then 256 MiB of status requests
    // whose answers it never reads.
    crate::conn::write_msg(&mut s, &ControlMsg::Poll { rank: 0, after: 0 }).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let one = ControlMsg::Status.encode();
    let junk: Vec<u8> = one.iter().copied().cycle().take(one.len() * (200 << 10)).collect();
    let mut sent = 0usize;
    while sent < 256 << 20 {
        match s.write(&junk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(sent < 64 << 20, "the control plane took {} MiB ahead of its answers", sent >> 20);
    assert!(status(addr, &secret).contains("servers: 0/2 registered"), "the others are served");
}

/// Peers that connect and never prove the secret hold at most
/// `MAX_UNPROVEN` of the control plane's connections; the job's own
/// peers are served meanwhile.
#[test]
fn connections_that_prove_nothing_are_bounded() {
    let (addr, secret) = serve("unproven");
    let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    let before = fds();
    let n = 400;
    let idle: Vec<std::net::TcpStream> = (0..n).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
    // Every one accepted (the service's end of each is a descriptor of
    // this process too), then a real client served.
    assert!(status(addr, &secret).contains("servers: 0/2 registered"));
    let held = fds() - before - n;
    assert!(held <= MAX_UNPROVEN + 8, "the control plane holds {held} connections that proved nothing");
    drop(idle);
}

/// One thread serves every connection: 40 clients waiting in a long poll
/// at once are all answered, and the service has no thread for any.
#[test]
fn one_thread_serves_many_clients_waiting_at_once() {
    let (addr, secret) = serve("many");
    let threads = || std::fs::read_dir("/proc/self/task").unwrap().count();
    let before = threads();
    let mut socks: Vec<std::net::TcpStream> = (0..40)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            crate::conn::auth_client(&mut s, &secret).unwrap();
            // No orders for server 0: each waits a long poll.
            crate::conn::write_msg(&mut s, &ControlMsg::Poll { rank: 0, after: 0 }).unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(threads(), before, "threads for waiting clients");
    let started = Instant::now();
    for s in &mut socks {
        let m = crate::conn::read_msg(s).unwrap();
        assert!(matches!(m, ControlMsg::Orders { ref orders, .. } if orders.is_empty()), "{m:?}");
    }
    let waited = started.elapsed() + Duration::from_millis(100);
    assert!(waited > LONG_POLL / 2 && waited < LONG_POLL * 2, "answered together after one long poll: {waited:?}");
    // A wrong secret is refused and holds nothing up.
    let bad = Secret::new("wrong").unwrap();
    assert!(ControlClient::connect(addr, &bad, Duration::from_secs(5)).is_err());
    assert!(status(addr, &secret).contains("servers: 0/2 registered"));
}

/// The last worker finishes and the server is told to retire; its order
/// poll drops before it says it finished (it died as the job ended), or
/// dropped earlier, when its loss changed nothing (a job without replicas):
/// it is counted finished and the service exits, with nobody to answer.
#[test]
fn a_job_whose_last_server_dies_as_it_retires_ends_the_service() {
    for died_before in [false, true] {
        let text = "[job]\nworkers = 1\nservers = 1\n[model]\ntensors = [{ name = \"w\", elements = 256 }]\n";
        let spec = JobSpec::from_toml(text).unwrap();
        let secret = Secret::new("last-server").unwrap();
        let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let svc = ControlService::bind(any, &spec, text, secret.clone(), Box::new(crate::store::MemStore::default())).unwrap();
        let addr = svc.local_addr();
        let service = std::thread::spawn(move || svc.run());
        let mut server = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
        assert!(matches!(server.register(Role::Server).unwrap(), (0, _)));
        let ep = |s: &eps_proto::layout::Shard| ShardEndpoint {
            shard: s.id,
            owner: 0,
            landing: vec![(1, 2)],
            published_addr: 0,
            published_rkey: 0,
        };
        let shards = spec.layout().unwrap().shards_of(0).map(ep).collect();
        server.call(&ControlMsg::ServerReady { rank: 0, fabric_addr: "127.0.0.1:1".into(), shards }).unwrap();
        let mut worker = ControlClient::connect(addr, &secret, Duration::from_secs(5)).unwrap();
        assert!(matches!(worker.register(Role::Worker).unwrap(), (0, _)));
        let poll = |server: &mut ControlClient| {
            let ControlMsg::Orders { orders, .. } = server.call(&ControlMsg::Poll { rank: 0, after: 0 }).unwrap() else {
                panic!("no orders")
            };
            orders
        };
        if died_before {
            poll(&mut server);
            drop(server);
            // Past the grace of a dropped poll: found gone, nothing declared.
            std::thread::sleep(SERVER_GRACE + TICK * 3);
            worker.call(&ControlMsg::Finished { role: Role::Worker, rank: 0 }).unwrap();
        } else {
            worker.call(&ControlMsg::Finished { role: Role::Worker, rank: 0 }).unwrap();
            assert!(poll(&mut server).contains(&Order::Retire));
            drop(server);
        }
        let deadline = Instant::now() + SERVER_GRACE + Duration::from_secs(10);
        while !service.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(service.is_finished(), "the job is over, yet the control plane still runs (died before: {died_before})");
        assert!(service.join().unwrap().is_ok());
    }
}
