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

/// A move its source stopped before the cutover (the link to the target
/// alone was cut) is cancelled: the target drops its copy, and a shard left
/// on a leaving server moves again. A stop from anyone else, or after the
/// cutover, is refused.
#[test]
fn a_move_its_source_stopped_is_cancelled_and_planned_again() {
    use eps_proto::control::{MigrationKeys, Order};
    let spec = JobSpec::from_toml(SPEC).unwrap();
    let layout = spec.layout().unwrap();
    let mut job = Job::new(&spec, SPEC).unwrap();
    let ep = |shard: u32, owner: u32| ShardEndpoint { shard, owner, landing: vec![(0, 0)], published_addr: 0, published_rkey: 0 };
    for r in 0..3u32 {
        job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        let shards = layout.shards_of(r).map(|s| ep(s.id, r)).collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    let moving_in = |job: &Job, to: u32, after: u64| -> Vec<u32> {
        let orders = job.orders_for(to, after).1;
        orders
            .iter()
            .filter_map(|o| match o {
                Order::MigrateIn { shard, from: 2, .. } => Some(*shard),
                _ => None,
            })
            .collect()
    };
    let shard = moving_in(&job, 0, 0)[0];
    let keys = MigrationKeys { state_addr: 0, state_rkey: 0, grad_addr: 0, grad_rkey: 0 };
    job.apply(&ControlMsg::ShardReady { endpoint: ep(shard, 0), keys }).unwrap();
    let before = job.orders_issued();

    // Only the source may stop it.
    let e = job.apply(&ControlMsg::MoveStopped { shard, rank: 1 }).unwrap_err();
    assert!(e.contains("not moving"), "{e}");
    job.apply(&ControlMsg::MoveStopped { shard, rank: 2 }).unwrap();
    assert!(job.status().contains("cancelled"), "{}", job.status());
    // The target drops its copy; the shard, still on a leaving server, is
    // ordered to move again.
    let (_, to_0) = job.orders_for(0, before);
    assert!(to_0.contains(&Order::DropBackup { shard }), "{to_0:?}");
    let again: Vec<u32> = (0..2).flat_map(|t| moving_in(&job, t, before)).collect();
    assert_eq!(again, vec![shard], "moved again: {again:?}");

    // Past its cutover, a move cannot stop.
    let t = (0..2).find(|&t| !moving_in(&job, t, before).is_empty()).unwrap();
    job.apply(&ControlMsg::ShardReady { endpoint: ep(shard, t), keys }).unwrap();
    job.apply(&ControlMsg::Cutover { shard, at: 3 }).unwrap();
    let e = job.apply(&ControlMsg::MoveStopped { shard, rank: 2 }).unwrap_err();
    assert!(e.contains("past its cutover"), "{e}");
}

/// A job with sparse tables is ready once every initial server reported its
/// parts of them (one per table, a region per worker rank) and is ready; the
/// map carries them; scale events are refused while buckets cannot move.
#[test]
fn sparse_tables_are_reported_before_servers_are_ready_and_block_scaling() {
    let text = "[job]\nworkers = 2\nservers = 2\n[model]\ntensors = [{ name = \"w\", elements = 4096 }]\n\
                [[model.tables]]\nname = \"a\"\ndim = 4\n[[model.tables]]\nname = \"b\"\ndim = 2\n";
    let spec = JobSpec::from_toml(text).unwrap();
    let layout = spec.layout().unwrap();
    let mut job = Job::new(&spec, text).unwrap();
    let ep = |shard: u32, owner: u32, workers: usize| ShardEndpoint {
        shard,
        owner,
        landing: vec![(4096 * u64::from(owner), 7); workers],
        published_addr: 0,
        published_rkey: 0,
    };
    for _ in 0..2 {
        job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
    }
    let bad = [vec![ep(0, 0, 2)], vec![ep(1, 0, 2), ep(0, 0, 2)], vec![ep(0, 0, 1), ep(1, 0, 1)], vec![ep(0, 1, 2), ep(1, 1, 2)]];
    for tables in bad {
        let e = job.apply(&ControlMsg::TablesReady { rank: 0, tables: tables.clone() }).unwrap_err();
        assert!(e.contains("sparse table"), "{tables:?}: {e}");
    }
    for r in 0..2u32 {
        job.apply(&ControlMsg::TablesReady { rank: r, tables: vec![ep(0, r, 2), ep(1, r, 2)] }).unwrap();
        assert!(!job.initial_ready());
        let shards = layout.shards_of(r).map(|s| ep(s.id, r, 2)).collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
    assert!(job.initial_ready());
    let again = job.apply(&ControlMsg::TablesReady { rank: 1, tables: vec![ep(0, 1, 2), ep(1, 1, 2)] }).unwrap_err();
    assert!(again.contains("does not hold"), "{again}");
    let map = job.job_map();
    assert_eq!(map.tables.len(), 4);
    assert!(map.tables.iter().any(|e| e.owner == 1 && e.shard == 1 && e.landing[1] == (4096, 7)));
    for m in [ControlMsg::Scale { servers: 3 }, ControlMsg::ScaleWorkers { workers: 1 }] {
        let e = job.apply(&m).unwrap_err();
        assert!(e.contains("sparse tables"), "{m:?}: {e}");
    }
}
