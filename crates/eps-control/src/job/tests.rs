//! Orders: each server's are kept until it polls past them, and numbers stay
//! as issued.

use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, Role, ShardEndpoint};

use crate::job::Job;

const SPEC: &str = "[job]\nworkers = 1\nservers = 3\nshard_bytes = 4096\n\
                    [model]\npreset = \"synthetic\"\nbuckets = 8192\n";

#[test]
fn orders_a_server_polled_past_are_dropped_and_the_others_kept() {
    let spec = JobSpec::from_toml(SPEC).unwrap();
    let layout = spec.layout().unwrap();
    let mut job = Job::new(&spec, SPEC).unwrap();
    for r in 0..3u32 {
        job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        let shards = layout
            .shards_of(r)
            .map(|s| ShardEndpoint { shard: s.id, owner: r, landing: vec![(0, 0)], published_addr: 0, published_rkey: 0 })
            .collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
    // Scaling in to two servers: server 2's shards move to 0 and 1.
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    let issued = job.orders_issued();
    let all: Vec<_> = (0..3).map(|r| job.orders_for(r, 0).1).collect();
    assert!(!all[0].is_empty() && !all[1].is_empty(), "{all:?}");
    assert_eq!(all.iter().map(Vec::len).sum::<usize>() as u64, issued, "{all:?}");

    // Server 0 polls past everything so far: its orders go, nobody else's.
    assert_eq!(job.orders_polled(0, issued), 0);
    assert_eq!(job.orders_for(0, 0), (issued, Vec::new()));
    assert_eq!(job.orders_for(1, 0), (issued, all[1].clone()));
    // A poll from before (a late one) takes nothing back.
    assert_eq!(job.orders_polled(0, issued - 1), 0);

    // Orders issued later keep counting from there; a server that polled
    // past part of its orders keeps the rest.
    job.apply(&ControlMsg::Checkpoint { version: 5, dir: "/ckpt".into() }).unwrap();
    let (last, mine) = job.orders_for(0, issued);
    assert_eq!((last, mine.len()), (issued + 3, 1), "{mine:?}");
    assert_eq!(job.orders_polled(1, issued), 1, "server 1 keeps only its checkpoint order");
    assert_eq!(job.orders_for(1, issued).1, job.orders_for(1, 0).1);
    assert_eq!(job.orders_polled(0, last), 0);
}
