//! Orders: each server's are kept until it polls past them, and numbers stay
//! as issued.

use eps_proto::JobSpec;
use eps_proto::control::{ControlMsg, ErrorCode, Order, Role, RowsBackup, ShardEndpoint};

use crate::job::Job;

const SPEC: &str = "[job]\nworkers = 1\nservers = 3\nshard_bytes = 4096\n\
                    [model]\ntensors = [{ name = \"dense.weight\", elements = 256 }, { name = \"dense.bias\", elements = 4 }, { name = \"sparse.embedding\", elements = 32768 }]\n";

#[test]
fn orders_a_server_polled_past_are_dropped_and_the_others_kept() {
    let spec = JobSpec::from_toml(SPEC).unwrap();
    let mut job = Job::new(&spec, SPEC).unwrap();
    ready_servers(&mut job, &spec);
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
    assert!(e.code == ErrorCode::Stale && e.message.contains("not moving"), "{e:?}");
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
    assert!(e.code == ErrorCode::Stale && e.message.contains("past its cutover"), "{e:?}");
}

/// A job with sparse tables is ready once every initial server reported its
/// parts of them (one per table, a region per worker rank) and is ready; the
/// map carries them.
#[test]
fn sparse_tables_are_reported_before_servers_are_ready() {
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
        assert!(e.code == ErrorCode::Invalid && e.message.contains("sparse table"), "{tables:?}: {e:?}");
    }
    for r in 0..2u32 {
        job.apply(&ControlMsg::TablesReady { rank: r, tables: vec![ep(0, r, 2), ep(1, r, 2)] }).unwrap();
        assert!(!job.initial_ready());
        let shards = layout.shards_of(r).map(|s| ep(s.id, r, 2)).collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
    assert!(job.initial_ready());
    let again = job.apply(&ControlMsg::TablesReady { rank: 1, tables: vec![ep(0, 1, 2), ep(1, 1, 2)] }).unwrap_err();
    assert!(again.code == ErrorCode::Stale && again.message.contains("twice"), "{again:?}");
    let map = job.job_map();
    assert_eq!(map.tables.len(), 4);
    assert!(map.tables.iter().any(|e| e.owner == 1 && e.shard == 1 && e.landing[1] == (4096, 7)));
}

const TABLE_JOB: &str = "[job]\nworkers = 1\nservers = 1\n[model]\ntensors = [{ name = \"w\", elements = 1024 }]\n\
                         [[model.tables]]\nname = \"a\"\ndim = 4\n";

fn table_ep(owner: u32) -> ShardEndpoint {
    ShardEndpoint { shard: 0, owner, landing: vec![(1, 2)], published_addr: 0, published_rkey: 0 }
}

/// Server `r` of [`TABLE_JOB`] registers, reports its table and is ready.
fn join_table_server(job: &mut Job, r: u32) {
    let layout = JobSpec::from_toml(TABLE_JOB).unwrap().layout().unwrap();
    job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
    job.apply(&ControlMsg::TablesReady { rank: r, tables: vec![table_ep(r)] }).unwrap();
    let shards = layout.shards_of(r).map(|s| ShardEndpoint { shard: s.id, ..table_ep(r) }).collect();
    job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
}

/// Everyone votes on the open proposal, which is then committed.
fn vote_all(job: &mut Job, holds: &[(Role, u32, u64)]) {
    let id = job.job_map().proposal;
    assert_ne!(id, 0, "a vote is open: {}", job.status());
    for &(role, rank, hold) in holds {
        job.apply(&ControlMsg::Vote { role, rank, id, hold }).unwrap();
    }
    assert_eq!(job.job_map().proposal, 0);
}

/// [`TABLE_JOB`]'s dense shard moves to server `to` at `at` (buckets move
/// after it).
fn move_dense_shard(job: &mut Job, to: u32, at: u64) {
    let keys = eps_proto::control::MigrationKeys { state_addr: 1, state_rkey: 2, grad_addr: 3, grad_rkey: 4 };
    assert_eq!(job.job_map().proposal, 0, "no vote while a shard moves");
    job.apply(&ControlMsg::ShardReady { endpoint: table_ep(to), keys }).unwrap();
    job.apply(&ControlMsg::Cutover { shard: 0, at }).unwrap();
    job.apply(&ControlMsg::Released { shard: 0, bytes: 4096, millis: 1 }).unwrap();
}

/// [`TABLE_JOB`] scaled up: server 1 joins and gets half of the buckets
/// from iteration 7 on.
fn table_job_scaled_up() -> Job {
    let spec = JobSpec::from_toml(TABLE_JOB).unwrap();
    let mut job = Job::new(&spec, TABLE_JOB).unwrap();
    join_table_server(&mut job, 0);
    job.apply(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    join_table_server(&mut job, 1);
    move_dense_shard(&mut job, 1, 3);
    vote_all(&mut job, &[(Role::Worker, 0, 7), (Role::Server, 0, 4), (Role::Server, 1, 1)]);
    job
}

/// Scaling the servers of a job with tables moves buckets: a vote, a commit
/// at the largest hold with every server told, the source's rows fetched by
/// the target, and a leaving server retired only once its rows are taken and
/// every worker routes past the cutover.
#[test]
fn buckets_move_to_added_servers_and_off_leaving_ones() {
    let mut job = table_job_scaled_up();
    let orders = |job: &Job, r: u32| job.orders_for(r, 0).1;
    let map = job.job_map();
    assert_eq!(map.buckets, vec![(0, vec![(0, 0)]), (7, vec![(0, 0), (2048, 1)])]);
    for r in 0..2 {
        assert!(orders(&job, r).contains(&Order::Buckets { at: 7, runs: vec![(0, 0), (2048, 1)] }), "server {r}");
    }
    let busy = job.apply(&ControlMsg::Scale { servers: 1 }).unwrap_err();
    assert!(busy.code == ErrorCode::ChangeInProgress && busy.code.is_temporary(), "{busy:?}");
    assert!(job.apply(&ControlMsg::RowsOut { rank: 1, from: 1, to: 0, addr: 1, rkey: 2, len: 3 }).is_err(), "no such move");
    job.apply(&ControlMsg::RowsOut { rank: 0, from: 0, to: 1, addr: 64, rkey: 9, len: 4000 }).unwrap();
    let fetch = Order::FetchRows { from: 0, to: 1, via: 0, from_addr: "127.0.0.1:7000".into(), addr: 64, rkey: 9, len: 4000 };
    assert!(orders(&job, 1).contains(&fetch));
    job.apply(&ControlMsg::RowsTaken { rank: 1, from: 0, to: 1 }).unwrap();
    assert!(orders(&job, 0).contains(&Order::FreeRows { to: 1 }));
    assert!(job.status().contains("server 0: 2048, server 1: 2048; 1 moves done"), "{}", job.status());

    // Down: server 1 gives its buckets back, then retires once the worker
    // routes past the cutover.
    job.apply(&ControlMsg::Scale { servers: 1 }).unwrap();
    move_dense_shard(&mut job, 0, 18);
    vote_all(&mut job, &[(Role::Worker, 0, 20), (Role::Server, 0, 19), (Role::Server, 1, 19)]);
    assert_eq!(job.job_map().buckets.last(), Some(&(20, vec![(0, 0)])));
    job.apply(&ControlMsg::RowsOut { rank: 1, from: 1, to: 0, addr: 64, rkey: 9, len: 4000 }).unwrap();
    job.apply(&ControlMsg::RowsTaken { rank: 0, from: 1, to: 0 }).unwrap();
    assert!(!orders(&job, 1).contains(&Order::Retire), "the worker still routes by the old map");
    let epoch = job.epoch();
    job.apply(&ControlMsg::GetMap { worker: 0, adopted: epoch, min_epoch: 0, iteration: 20 }).unwrap();
    assert!(orders(&job, 1).contains(&Order::Retire));
    assert!(job.job_map().tables.iter().all(|e| e.owner == 0), "a retired server's regions leave the map");
}

/// The job ends (its last worker finished) while a bucket move's target
/// READs the rows its source took out: neither is told to retire until the
/// rows are taken (the source would exit under the READ, which would fail).
/// A move whose rows were never taken out (its cutover came after the last
/// step) holds nobody back.
#[test]
fn the_job_end_waits_for_rows_being_read() {
    let mut job = table_job_scaled_up();
    let retired = |job: &Job, r: u32| job.orders_for(r, 0).1.contains(&Order::Retire);
    job.apply(&ControlMsg::RowsOut { rank: 0, from: 0, to: 1, addr: 64, rkey: 9, len: 4000 }).unwrap();
    job.apply(&ControlMsg::Finished { role: Role::Worker, rank: 0 }).unwrap();
    assert!(!retired(&job, 0) && !retired(&job, 1), "the rows are being READ");
    job.apply(&ControlMsg::RowsTaken { rank: 1, from: 0, to: 1 }).unwrap();
    assert!(retired(&job, 0) && retired(&job, 1), "the READ is done: the job ends");

    let mut job = table_job_scaled_up();
    job.apply(&ControlMsg::Finished { role: Role::Worker, rank: 0 }).unwrap();
    assert!(retired(&job, 0) && retired(&job, 1), "no rows were out");
}

fn ready_servers(job: &mut Job, spec: &JobSpec) {
    let layout = spec.layout().unwrap();
    for r in 0..spec.job.servers {
        job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        let shards = layout
            .shards_of(r)
            .map(|s| ShardEndpoint { shard: s.id, owner: r, landing: vec![(0, 0)], published_addr: 0, published_rkey: 0 })
            .collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
}

/// Counts past their bounds are refused with `Limit` and change nothing (a
/// worker count near 2^32 once overflowed the rank arithmetic); a scale-up
/// whose servers never came is replaced by the next scale instead of
/// blocking every later one.
#[test]
fn scale_refusals_leave_the_job_as_it_was() {
    let spec = JobSpec::from_toml(SPEC).unwrap();
    let mut job = Job::new(&spec, SPEC).unwrap();
    ready_servers(&mut job, &spec);
    job.apply(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
    let before = (job.status(), job.orders_issued(), job.epoch());
    for servers in [eps_proto::spec::MAX_SERVERS + 1, u32::MAX] {
        let e = job.apply(&ControlMsg::Scale { servers }).unwrap_err();
        assert_eq!(e.code, ErrorCode::Limit, "{e:?}");
    }
    for workers in [2, u32::MAX] {
        let e = job.apply(&ControlMsg::ScaleWorkers { workers }).unwrap_err();
        assert_eq!(e.code, ErrorCode::Limit, "{e:?}");
    }
    assert_eq!((job.status(), job.orders_issued(), job.epoch()), before);

    // Up to 5 servers, and none is started: worker changes wait for them...
    job.apply(&ControlMsg::Scale { servers: 5 }).unwrap();
    assert!(job.status().contains("servers: 3/5 registered"), "{}", job.status());
    // ...until the operator scales again: the new count replaces the old.
    job.apply(&ControlMsg::Scale { servers: 3 }).unwrap();
    assert!(job.status().contains("servers: 3/3 registered"), "{}", job.status());
    let e = job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap_err();
    assert_eq!(e.code, ErrorCode::Full, "{e:?}");
    job.apply(&ControlMsg::Scale { servers: 4 }).unwrap();
    job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
}

/// A change applied once and sent again under its id (its answer was lost)
/// is refused as `AlreadyApplied`; any other request that does not fit is
/// `Stale`, even the same change under another id.
#[test]
fn a_resent_change_is_known_from_a_stale_one() {
    use eps_proto::control::MigrationKeys;
    let spec = JobSpec::from_toml(SPEC).unwrap();
    let mut job = Job::new(&spec, SPEC).unwrap();
    ready_servers(&mut job, &spec);
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    let (shard, to) = (0..2)
        .find_map(|t| {
            job.orders_for(t, 0).1.iter().find_map(|o| match o {
                Order::MigrateIn { shard, .. } => Some((*shard, t)),
                _ => None,
            })
        })
        .unwrap();
    let keys = MigrationKeys { state_addr: 0, state_rkey: 0, grad_addr: 0, grad_rkey: 0 };
    let ep = ShardEndpoint { shard, owner: to, landing: vec![(0, 0)], published_addr: 0, published_rkey: 0 };
    let once = |seq: u64, m: ControlMsg| ControlMsg::Once { id: (77, seq), change: Box::new(m) };
    job.apply(&once(1, ControlMsg::ShardReady { endpoint: ep.clone(), keys })).unwrap();
    job.apply(&once(2, ControlMsg::Cutover { shard, at: 3 })).unwrap();
    let epoch = job.epoch();
    // Re-sends: the same ids.
    for (seq, m) in [(2, ControlMsg::Cutover { shard, at: 3 }), (1, ControlMsg::ShardReady { endpoint: ep.clone(), keys })] {
        let again = job.apply(&once(seq, m)).unwrap_err();
        assert_eq!(again.code, ErrorCode::AlreadyApplied, "{again:?}");
    }
    // The same change under a new id is a new request, refused as stale;
    // so is one that never had an id.
    let same_new_id = job.apply(&once(3, ControlMsg::Cutover { shard, at: 3 })).unwrap_err();
    assert_eq!(same_new_id.code, ErrorCode::Stale, "{same_new_id:?}");
    let untagged = job.apply(&ControlMsg::Cutover { shard, at: 3 }).unwrap_err();
    assert_eq!(untagged.code, ErrorCode::Stale, "{untagged:?}");
    assert_eq!(job.epoch(), epoch, "refusals change nothing");
}

/// A rank nobody registered for has no lease: the job's first workers may
/// come as late as they like. A rank a scale admitted is awaited (it has the
/// join deadline) and may be expired; a refused registration says why.
#[test]
fn unregistered_ranks_hold_no_lease_and_scaled_ones_are_awaited() {
    let text = "[job]\nworkers = 2\nmax_workers = 3\nservers = 3\nshard_bytes = 4096\n\
                [model]\ntensors = [{ name = \"dense.weight\", elements = 256 }, { name = \"dense.bias\", elements = 4 }, { name = \"sparse.embedding\", elements = 32768 }]\n";
    let spec = JobSpec::from_toml(text).unwrap();
    let mut job = Job::new(&spec, text).unwrap();
    ready_servers(&mut job, &spec);
    assert!(job.leased_workers().is_empty() && job.awaited_workers().is_empty());
    // Nothing to expire for a rank that has not registered.
    let e = job.apply(&ControlMsg::Expire { rank: 1 }).unwrap_err();
    assert_eq!(e.code, ErrorCode::Stale, "{e:?}");
    let reg = |job: &mut Job| job.apply(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() });
    reg(&mut job).unwrap();
    assert_eq!(job.leased_workers(), vec![0]);
    reg(&mut job).unwrap();
    assert_eq!(job.leased_workers(), vec![0, 1]);

    job.apply(&ControlMsg::ScaleWorkers { workers: 3 }).unwrap();
    let id = job.w.proposal_id();
    let voters: Vec<(Role, u32)> = (0..2).map(|r| (Role::Worker, r)).chain((0..3).map(|r| (Role::Server, r))).collect();
    for (role, rank) in voters {
        job.apply(&ControlMsg::Vote { role, rank, id, hold: 0 }).unwrap();
    }
    assert_eq!(job.w.members.latest(), &[0, 1, 2]);
    assert_eq!((job.leased_workers(), job.awaited_workers()), (vec![0, 1], vec![2]));
    // Its process never came: expired at the join deadline.
    job.apply(&ControlMsg::Expire { rank: 2 }).unwrap();
    assert!(job.awaited_workers().is_empty());
    assert_eq!(job.w.state(2), "expired");
    let e = reg(&mut job).unwrap_err();
    assert_eq!(e.code, ErrorCode::Full);
    assert!(e.message.contains("running [0, 1], removed after their lease expired [2]"), "{}", e.message);
    assert!(e.message.contains("job.max_workers = 3"), "{}", e.message);
}

/// A job ends once nothing it waits for can come: the last worker removed
/// by its lease after the others finished ends it (every server is told to
/// retire), and a server told to retire that dies before it says it finished
/// counts as finished once it is gone (`Job::server_gone`). A serving
/// server's loss changes nothing without replicas.
#[test]
fn a_job_ends_when_its_last_worker_expires_and_a_retiring_server_dies() {
    let text = "[job]\nworkers = 2\nservers = 2\nshard_bytes = 4096\n[model]\ntensors = [{ name = \"w\", elements = 4096 }]\n";
    let spec = JobSpec::from_toml(text).unwrap();
    let mut job = Job::new(&spec, text).unwrap();
    ready_servers(&mut job, &spec);
    for _ in 0..2 {
        job.apply(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
    }
    assert_eq!(job.server_gone(1), None, "a serving server of a job without replicas");
    job.apply(&ControlMsg::Finished { role: Role::Worker, rank: 0 }).unwrap();
    assert!(!job.orders_for(0, 0).1.contains(&Order::Retire), "worker 1 still trains");
    job.apply(&ControlMsg::Expire { rank: 1 }).unwrap();
    for r in 0..2 {
        assert!(job.orders_for(r, 0).1.contains(&Order::Retire), "server {r} is told to retire");
    }
    job.apply(&ControlMsg::Finished { role: Role::Server, rank: 0 }).unwrap();
    assert!(!job.done(), "server 1 has not finished");
    assert_eq!(job.server_gone(0), None, "a server that finished");
    let m = job.server_gone(1).expect("a retiring server that is gone");
    job.apply(&m).unwrap();
    assert!(job.done());
    assert!(job.apply(&m).is_err(), "once");
}

/// With replicas, each server's table rows are kept on the next server that
/// owns buckets, ordered once every one is ready (each inbox known).
#[test]
fn table_rows_are_backed_up_around_the_ring_once_every_server_is_ready() {
    let text = "[job]\nworkers = 1\nservers = 3\nreplicas = 2\n[model]\ntensors = [{ name = \"w\", elements = 4096 }]\n\
                [[model.tables]]\nname = \"a\"\ndim = 4\n";
    let spec = JobSpec::from_toml(text).unwrap();
    let layout = spec.layout().unwrap();
    let mut job = Job::new(&spec, text).unwrap();
    let ep = |owner: u32| ShardEndpoint {
        shard: 0,
        owner,
        landing: vec![(1, 2)],
        published_addr: 1 << (40 + owner),
        published_rkey: 10 + owner,
    };
    let backup_orders = |job: &Job, r: u32| -> Vec<Order> {
        job.orders_for(r, 0).1.into_iter().filter(|o| matches!(o, Order::BackupRows { .. })).collect()
    };
    for r in 0..3u32 {
        job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        job.apply(&ControlMsg::TablesReady { rank: r, tables: vec![ep(r)] }).unwrap();
        let shards = layout.shards_of(r).map(|s| ShardEndpoint { shard: s.id, ..ep(r) }).collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
        if r < 2 {
            assert!(backup_orders(&job, 0).is_empty(), "ordered before server 2 was ready");
        }
    }
    for r in 0..3u32 {
        let b = (r + 1) % 3;
        let want = RowsBackup { rank: b, addr: format!("127.0.0.1:{}", 7000 + b), inbox: vec![(1 << (40 + b), 10 + b)] };
        assert_eq!(backup_orders(&job, r), vec![Order::BackupRows { to: Some(want) }], "server {r}");
        assert_eq!(job.rows_backup_of(r), Some(b));
    }
    assert!(job.status().contains("rows kept in step on (server -> backup): 0 -> 1, 1 -> 2, 2 -> 0"), "{}", job.status());
}

/// A lost server's table rows: its backup is ordered to stand in, and once
/// it reports where workers WRITE, the job map names it as the heir and its
/// endpoints replace the lost server's; a stand-in lost in turn loses the
/// rows it stood in for (and its own rows get a stand-in); a backup that
/// held no whole copy reports none, and the rows are named lost.
/// A job of 3 servers with a table and `workers` registered workers, every
/// server ready.
fn three_table_servers(workers: u32) -> Job {
    let text = "[job]\nworkers = 1\nservers = 3\nreplicas = 2\n[model]\ntensors = [{ name = \"w\", elements = 4096 }]\n\
                [[model.tables]]\nname = \"a\"\ndim = 4\n";
    let spec = JobSpec::from_toml(text).unwrap();
    let layout = spec.layout().unwrap();
    let mut job = Job::new(&spec, text).unwrap();
    for r in 0..3u32 {
        job.apply(&ControlMsg::Register { role: Role::Server, fabric_addr: String::new() }).unwrap();
        job.apply(&ControlMsg::TablesReady { rank: r, tables: vec![ep(r, 100 + u64::from(r))] }).unwrap();
        let shards = layout.shards_of(r).map(|s| ShardEndpoint { shard: s.id, ..ep(r, 0) }).collect();
        job.apply(&ControlMsg::ServerReady { rank: r, fabric_addr: format!("127.0.0.1:{}", 7000 + r), shards }).unwrap();
    }
    for _ in 0..workers {
        job.apply(&ControlMsg::Register { role: Role::Worker, fabric_addr: String::new() }).unwrap();
    }
    job
}

/// Table 0's endpoint of `owner`, landing at `addr`.
fn ep(owner: u32, addr: u64) -> ShardEndpoint {
    ShardEndpoint { shard: 0, owner, landing: vec![(addr, 2)], published_addr: 1, published_rkey: 1 }
}

#[test]
fn a_lost_servers_rows_are_served_by_its_backup_and_named_lost_without_one() {
    let mut job = three_table_servers(0);
    let stand_in =
        |job: &Job, r: u32| job.orders_for(r, 0).1.into_iter().filter(|o| matches!(o, Order::StandIn { .. })).collect::<Vec<_>>();
    let lost = job.server_gone(1).expect("a serving server with replicas");
    job.apply(&lost).unwrap();
    assert_eq!(stand_in(&job, 2), vec![Order::StandIn { from: 1, give: Vec::new(), take: Vec::new() }]);
    assert!(job.job_map().heirs.is_empty(), "named before it is ready");
    let wrong = ControlMsg::StandInReady { rank: 0, from: 1, tables: vec![ep(1, 900)] };
    assert!(job.apply(&wrong).is_err(), "a server not told to stand in");
    let epoch = job.job_map().epoch;
    job.apply(&ControlMsg::StandInReady { rank: 2, from: 1, tables: vec![ep(1, 900)] }).unwrap();
    let m = job.job_map();
    assert!(m.epoch > epoch);
    assert_eq!(m.heirs, vec![(1, Some(2))]);
    let of_1: Vec<_> = m.tables.iter().filter(|e| e.owner == 1).map(|e| e.landing.clone()).collect();
    assert_eq!(of_1, vec![vec![(900, 2)]], "the stand-in's regions replace the lost server's");
    assert!(job.status().contains("rows of lost servers: server 1's by server 2"), "{}", job.status());
    // The stand-in is lost: the rows it stood in for go with it; its own
    // rows' backup (server 0) stands in for it, and reports no whole copy.
    let lost = job.server_gone(2).expect("the stand-in");
    job.apply(&lost).unwrap();
    assert_eq!(stand_in(&job, 0), vec![Order::StandIn { from: 2, give: Vec::new(), take: Vec::new() }]);
    job.apply(&ControlMsg::StandInReady { rank: 0, from: 2, tables: Vec::new() }).unwrap();
    assert_eq!(job.job_map().heirs, vec![(1, None), (2, None)]);
}

/// Rows a stand-in took in as its own (the bucket move from the lost server
/// done) are no longer lost with it: they are its own rows, and its backup's
/// copy holds them.
#[test]
fn a_stand_ins_merged_rows_are_not_lost_with_it() {
    let mut job = three_table_servers(1);
    job.apply(&job.server_gone(1).expect("a serving server")).unwrap();
    job.apply(&ControlMsg::StandInReady { rank: 2, from: 1, tables: vec![ep(1, 900)] }).unwrap();
    vote_all(&mut job, &[(Role::Worker, 0, 5), (Role::Server, 0, 5), (Role::Server, 2, 5)]);
    assert!(job.job_map().buckets.last().is_some_and(|(_, runs)| runs.iter().all(|r| r.1 != 1)), "server 1's buckets move");
    job.apply(&ControlMsg::RowsTaken { rank: 2, from: 1, to: 2 }).unwrap();
    job.apply(&job.server_gone(2).expect("the stand-in")).unwrap();
    assert_eq!(job.job_map().heirs.first(), Some(&(1, Some(2))), "merged before it was lost");
}

/// The source of a bucket move lost during it (a scale-in: server 2 gives
/// its buckets to servers 0 and 1): its backup stands in and is told which
/// targets have not taken its rows; its report of them is taken as the lost
/// server's, and the targets READ them from it; another server's is not.
#[test]
fn a_lost_sources_stand_in_gives_its_rows_to_the_targets_waiting() {
    let mut job = three_table_servers(1);
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    let proposal = job.job_map().proposal;
    assert_ne!(proposal, 0, "a bucket move is voted: {}", job.status());
    vote_all(&mut job, &[(Role::Worker, 0, 9), (Role::Server, 0, 9), (Role::Server, 1, 9), (Role::Server, 2, 9)]);
    assert_eq!(job.rows_backup_of(2), Some(0));
    job.apply(&ControlMsg::RowsOut { rank: 2, from: 2, to: 0, addr: 64, rkey: 9, len: 4000 }).unwrap();
    job.apply(&ControlMsg::RowsTaken { rank: 0, from: 2, to: 0 }).unwrap();
    job.apply(&ControlMsg::RowsOut { rank: 2, from: 2, to: 1, addr: 64, rkey: 9, len: 4000 }).unwrap();
    job.apply(&job.server_gone(2).expect("a source with replicas")).unwrap();
    let orders = |job: &Job, r: u32| job.orders_for(r, 0).1;
    assert!(orders(&job, 0).contains(&Order::StandIn { from: 2, give: vec![1], take: Vec::new() }), "{:?}", orders(&job, 0));
    let early = ControlMsg::RowsOut { rank: 0, from: 2, to: 1, addr: 128, rkey: 3, len: 4000 };
    assert!(job.apply(&early).is_err(), "not its stand-in yet");
    job.apply(&ControlMsg::StandInReady { rank: 0, from: 2, tables: vec![ep(2, 900)] }).unwrap();
    let posing = ControlMsg::RowsOut { rank: 1, from: 2, to: 1, addr: 128, rkey: 3, len: 4000 };
    assert!(job.apply(&posing).is_err(), "server 1 holds none of server 2's rows");
    job.apply(&early).unwrap();
    let fetch = Order::FetchRows { from: 2, to: 1, via: 0, from_addr: "127.0.0.1:7000".into(), addr: 128, rkey: 3, len: 4000 };
    assert!(orders(&job, 1).contains(&fetch), "{:?}", orders(&job, 1));
    assert!(job.status().contains("rows not taken yet [(2, 1)]"), "{}", job.status());
    job.apply(&ControlMsg::RowsTaken { rank: 1, from: 2, to: 1 }).unwrap();
    assert!(job.status().contains("1 moves done") && !job.status().contains("rows not taken yet"), "{}", job.status());
}

#[test]
fn a_source_lost_once_its_rows_were_taken_is_named_its_own_heir() {
    let mut job = three_table_servers(1);
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    vote_all(&mut job, &[(Role::Worker, 0, 9), (Role::Server, 0, 9), (Role::Server, 1, 9), (Role::Server, 2, 9)]);
    for to in [0, 1] {
        job.apply(&ControlMsg::RowsOut { rank: 2, from: 2, to, addr: 64, rkey: 9, len: 4000 }).unwrap();
        job.apply(&ControlMsg::RowsTaken { rank: to, from: 2, to }).unwrap();
    }
    let gone = job.server_gone(2).expect("a retiring server");
    job.apply(&gone).unwrap();
    // (Workers awaiting its credit of the last push before the cutover
    // await it no more; nobody stands in for it.)
    assert_eq!(job.job_map().heirs, vec![(2, Some(2))]);
    assert!((0..2).all(|r| !job.orders_for(r, 0).1.iter().any(|o| matches!(o, Order::StandIn { .. }))));
    assert!(!job.status().contains("rows of lost servers"), "{}", job.status());
}

/// A target of a bucket move lost before it reported every source's rows
/// (scale-in: server 2 gives its buckets to servers 0 and 1; server 0 is
/// lost): its backup (server 1) stands in, is told which sources' rows it
/// takes in its place, and READs them once it serves the lost server's
/// rows; its report of them counts for the lost target, another's does not.
#[test]
fn a_lost_targets_stand_in_takes_the_rows_it_awaited() {
    let mut job = three_table_servers(1);
    job.apply(&ControlMsg::Scale { servers: 2 }).unwrap();
    vote_all(&mut job, &[(Role::Worker, 0, 9), (Role::Server, 0, 9), (Role::Server, 1, 9), (Role::Server, 2, 9)]);
    assert_eq!(job.rows_backup_of(0), Some(1));
    job.apply(&ControlMsg::RowsOut { rank: 2, from: 2, to: 0, addr: 64, rkey: 9, len: 4000 }).unwrap();
    job.apply(&job.server_gone(0).expect("a target with replicas")).unwrap();
    let orders = |job: &Job, r: u32| job.orders_for(r, 0).1;
    assert!(orders(&job, 1).contains(&Order::StandIn { from: 0, give: Vec::new(), take: vec![2] }), "{:?}", orders(&job, 1));
    let fetch = Order::FetchRows { from: 2, to: 0, via: 2, from_addr: "127.0.0.1:7002".into(), addr: 64, rkey: 9, len: 4000 };
    assert!(!orders(&job, 1).contains(&fetch), "not before it serves the lost server's rows");
    let early = ControlMsg::RowsTaken { rank: 1, from: 2, to: 0 };
    assert!(job.apply(&early).is_err(), "not its stand-in yet");
    job.apply(&ControlMsg::StandInReady { rank: 1, from: 0, tables: vec![ep(0, 900)] }).unwrap();
    assert!(orders(&job, 1).contains(&fetch), "{:?}", orders(&job, 1));
    assert!(job.apply(&ControlMsg::RowsTaken { rank: 2, from: 2, to: 0 }).is_err(), "server 2 does not stand in for it");
    job.apply(&early).unwrap();
    assert!(orders(&job, 2).contains(&Order::FreeRows { to: 0 }));
    assert!(job.status().contains("rows not taken yet [(2, 1)]"), "{}", job.status());
    // Server 1's own rows from server 2, out after the loss, go to server 1 itself.
    job.apply(&ControlMsg::RowsOut { rank: 2, from: 2, to: 1, addr: 96, rkey: 4, len: 500 }).unwrap();
    let own = Order::FetchRows { from: 2, to: 1, via: 2, from_addr: "127.0.0.1:7002".into(), addr: 96, rkey: 4, len: 500 };
    assert!(orders(&job, 1).contains(&own), "{:?}", orders(&job, 1));
    job.apply(&ControlMsg::RowsTaken { rank: 1, from: 2, to: 1 }).unwrap();
    assert!(job.status().contains("1 moves done"), "{}", job.status());
}
