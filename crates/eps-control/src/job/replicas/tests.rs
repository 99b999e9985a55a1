//! The replica rules record by record: through a scale-in, moves keep a
//! shard's backup unless it sits on the target or a leaving server, backups
//! on a leaving server are dropped and rebuilt elsewhere, and a leaving
//! server retires only once it keeps none; a loss during a membership vote,
//! and losses that leave no server to keep backups.

use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, MigrationKeys, Order, Role, ShardEndpoint};

use crate::job::Job;

const SPEC: &str = "[job]\nworkers = 1\nservers = 3\nreplicas = 2\nshard_bytes = 4096\n\
                    [model]\ntensors = [{ name = \"dense.weight\", elements = 256 }, { name = \"dense.bias\", elements = 4 }, { name = \"sparse.embedding\", elements = 32768 }]\n";

fn ep(shard: u32, owner: u32) -> ShardEndpoint {
    ShardEndpoint { shard, owner, landing: vec![(0, 0)], published_addr: 0, published_rkey: 0 }
}

const KEYS: MigrationKeys = MigrationKeys { state_addr: 1, state_rkey: 2, grad_addr: 3, grad_rkey: 4 };

/// Orders issued since `mark`, with their servers.
fn since(job: &Job, mark: u64) -> Vec<(u32, Order)> {
    let (last, _) = job.orders_for(0, 0);
    let mut out = Vec::new();
    for r in 0..8 {
        let (_, mine) = job.orders_for(r, mark);
        out.extend(mine.into_iter().map(|o| (r, o)));
    }
    assert!(last >= mark);
    out
}

#[test]
fn a_scale_in_keeps_moved_shards_backed_up_and_rebuilds_backups_of_a_leaving_server() {
    let (mut job, layout) = replicated_job();
    let n = layout.shards.len();
    assert!(job.status().contains(&format!("backups: {n} of {n} shards protected")), "{}", job.status());
    let owner_of = |id: u32| layout.shards.iter().find(|s| s.id == id).unwrap().server;
    let backup_of = |id: u32| layout.backup_server(owner_of(id));

    let (mark, _) = job.orders_for(0, 0);
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    let orders = since(&job, mark);
    let (mut waiting, mut kept) = (Vec::new(), 0);
    for s in layout.shards.iter() {
        let (id, owner, backup) = (s.id, s.server, backup_of(s.id));
        let stops = orders.iter().any(|(r, o)| *r == owner && *o == Order::Unreplicate { shard: id });
        if owner == 2 {
            // Moves: its backup goes along unless the target keeps it.
            let to = orders.iter().find_map(|(r, o)| matches!(o, Order::MigrateIn { shard, .. } if *shard == id).then_some(*r));
            match to {
                Some(to) => {
                    assert_ne!(to, backup, "shard {id}");
                    let forward = Order::Replicate {
                        shard: id,
                        to: backup,
                        to_addr: format!("127.0.0.1:{}", 7000 + backup),
                        keys: KEYS,
                        snapshot: false,
                    };
                    assert!(orders.contains(&(to, forward)), "shard {id}'s target forwards to its backup: {orders:?}");
                    assert!(!stops, "shard {id}");
                    kept += 1;
                }
                None => {
                    assert!(stops, "shard {id} moves to its backup's server: the backup goes first: {orders:?}");
                    waiting.push(id);
                }
            }
        } else if backup == 2 {
            assert!(stops, "shard {id}'s backup is on the leaving server: {orders:?}");
            waiting.push(id);
        } else {
            assert!(!stops, "shard {id} keeps its backup");
        }
    }
    // Both kinds of move happen: onto the server keeping the backup, and
    // onto the other one.
    assert!(kept > 0 && waiting.iter().any(|&id| owner_of(id) == 2), "{orders:?}");

    // The owners stop forwarding: backups on the leaving server are dropped
    // there and rebuilt on a server that stays; moves waiting for it start.
    for &id in &waiting {
        let (mark, _) = job.orders_for(0, 0);
        job.apply(&ControlMsg::Unreplicated { shard: id, rank: owner_of(id) }).unwrap();
        let orders = since(&job, mark);
        assert!(orders.iter().any(|(r, o)| *r == backup_of(id) && *o == Order::DropBackup { shard: id }), "{orders:?}");
        if owner_of(id) == 2 {
            assert!(orders.iter().any(|(_, o)| matches!(o, Order::MigrateIn { shard, .. } if *shard == id)), "{orders:?}");
        } else {
            let rebuilt =
                orders.iter().find_map(|(r, o)| matches!(o, Order::AddBackup { shard, .. } if *shard == id).then_some(*r));
            assert!(rebuilt.is_some_and(|r| r != 2 && r != owner_of(id)), "shard {id}: {orders:?}");
        }
    }
    assert!(job.status().contains("server 2: leaving"), "{}", job.status());

    // The moves end; a moved shard whose backup went gets a new one.
    for s in layout.shards_of(2) {
        let id = s.id;
        let all = since(&job, 0);
        let to = all
            .iter()
            .rev()
            .find_map(|(r, o)| matches!(o, Order::MigrateIn { shard, .. } if *shard == id).then_some(*r))
            .unwrap();
        job.apply(&ControlMsg::ShardReady { endpoint: ep(id, to), keys: KEYS }).unwrap();
        job.apply(&ControlMsg::Cutover { shard: id, at: 1 }).unwrap();
        let (mark, _) = job.orders_for(0, 0);
        job.apply(&ControlMsg::Released { shard: id, bytes: 1, millis: 1 }).unwrap();
        if waiting.contains(&id) {
            let orders = since(&job, mark);
            assert!(
                orders.iter().any(|(r, o)| *r != 2 && matches!(o, Order::AddBackup { shard, .. } if *shard == id)),
                "{orders:?}"
            );
        }
    }
    // Every shard is backed up again once the new backups report.
    assert!(job.status().contains(&format!("backups: {} of {n} shards protected", n - waiting.len())), "{}", job.status());
    // Server 2 holds nothing and keeps no backup: it retires.
    assert!(job.status().contains("server 2: retired"), "{}", job.status());
}

/// A job of three servers with every backup reported (up to 4 workers).
fn replicated_job() -> (Job, eps_proto::layout::Layout) {
    let text = SPEC.replace("workers = 1\n", "workers = 1\nmax_workers = 4\n");
    let spec = JobSpec::from_toml(&text).unwrap();
    let layout = spec.layout().unwrap();
    let mut job = Job::new(&spec, &text).unwrap();
    for _ in 0..3 {
        job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
    }
    for r in 0..3u32 {
        let shards = layout.shards_of(r).map(|s| ep(s.id, r)).collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
    for r in 0..3u32 {
        for s in layout.backups_of(r) {
            job.apply(&ControlMsg::BackupReady { endpoint: ep(s.id, r), keys: KEYS }).unwrap();
        }
    }
    (job, layout)
}

/// A server lost before it voted on a membership change: the servers its
/// shards were promoted to vote again (the lost one may have aggregated
/// past every vote cast), and the change commits after their new votes.
#[test]
fn a_server_lost_during_a_vote_is_replaced_by_the_servers_of_its_promoted_backups() {
    let (mut job, layout) = replicated_job();
    job.apply(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
    let (mark, _) = job.orders_for(0, 0);
    job.apply(&ControlMsg::ScaleWorkers { workers: 2 }).unwrap();
    let proposals: Vec<(u32, Order)> =
        since(&job, mark).into_iter().filter(|(_, o)| matches!(o, Order::Propose { .. })).collect();
    assert_eq!(proposals.len(), 3, "{proposals:?}");
    let Order::Propose { id } = proposals[0].1 else { unreachable!() };
    // Workers 0 and 1 and servers 0 and 2 vote; server 1 is lost before it does.
    job.apply(&ControlMsg::Vote { role: Role::Worker, rank: 0, id, hold: 3 }).unwrap();
    job.apply(&ControlMsg::Vote { role: Role::Worker, rank: 1, id, hold: 3 }).unwrap();
    job.apply(&ControlMsg::Vote { role: Role::Server, rank: 0, id, hold: 4 }).unwrap();
    job.apply(&ControlMsg::Vote { role: Role::Server, rank: 2, id, hold: 4 }).unwrap();
    assert!(job.job_map().proposal != 0, "the change waited for server 1's vote");
    let (mark, _) = job.orders_for(0, 0);
    job.apply(&ControlMsg::ServerLost { rank: 1 }).unwrap();
    let orders = since(&job, mark);
    // Server 1's shards are promoted on its backup's server, which votes again.
    let heir = layout.backup_server(1);
    assert!(layout.shards_of(1).all(|s| orders.contains(&(heir, Order::Promote { shard: s.id }))), "{orders:?}");
    assert!(orders.contains(&(heir, Order::Propose { id })), "{orders:?}");
    assert!(job.job_map().proposal != 0, "committed before the new vote");
    // Its new vote (past what server 1 aggregated) sets the first iteration.
    job.apply(&ControlMsg::Vote { role: Role::Server, rank: heir, id, hold: 9 }).unwrap();
    assert_eq!(job.job_map().proposal, 0);
    let members = job.job_map().membership;
    assert_eq!(members.last().unwrap().0, 9, "{members:?}");
}

/// Once no server is left to keep a backup, the owners are told to serve
/// alone (an owner still waiting to hear of its backup would wait forever).
#[test]
fn with_one_server_left_the_owners_are_told_their_shards_have_no_backup() {
    let (mut job, _layout) = replicated_job();
    job.apply(&ControlMsg::ServerLost { rank: 1 }).unwrap();
    let (mark, _) = job.orders_for(0, 0);
    assert!(!since(&job, 0).iter().any(|(_, o)| matches!(o, Order::NoBackup { .. })), "no backup while two servers are left");
    job.apply(&ControlMsg::ServerLost { rank: 2 }).unwrap();
    let orders = since(&job, mark);
    let ids: Vec<u32> = job.job_map().routes.iter().filter(|r| r.owner.owner == 0).map(|r| r.owner.shard).collect();
    assert!(!ids.is_empty());
    for &id in &ids {
        assert!(orders.contains(&(0, Order::NoBackup { shard: id })), "shard {id}: {orders:?}");
    }
    assert_eq!(job.unprotected_on(0), ids);
}
