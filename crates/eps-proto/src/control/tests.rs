//! Round trips and garbage for every control message; routes and splits.
use super::*;

fn ep(shard: u32, owner: u32) -> ShardEndpoint {
    ShardEndpoint { shard, owner, landing: vec![(1, 2), (5, 6)], published_addr: 3, published_rkey: 4 }
}

#[test]
fn roundtrip_and_garbage() {
    let keys = MigrationKeys { state_addr: 1, state_rkey: 2, grad_addr: 3, grad_rkey: 4 };
    let map = JobMap {
        epoch: 7,
        servers: vec![(0, "127.0.0.1:1".into()), (3, "127.0.0.1:2".into())],
        routes: vec![route(ep(0, 0), None), route(ep(1, 3), Some((ep(1, 0), 12)))],
        membership: vec![(0, vec![0, 1]), (9, vec![0, 1, 2])],
        proposal: 3,
        tables: vec![ep(0, 3), ep(1, 0)],
        buckets: vec![(0, vec![(0, 0), (2048, 1)]), (40, vec![(0, 0), (1366, 1), (2731, 2)])],
        heirs: vec![(1, Some(2)), (4, None)],
    };
    let msgs = vec![
        ControlMsg::Register { role: Role::Server, fabric_addr: "127.0.0.1:5".into() },
        ControlMsg::Registered { rank: 3, spec_toml: "[job]".into() },
        ControlMsg::ServerReady { rank: 1, fabric_addr: "127.0.0.1:9".into(), shards: vec![ep(0, 1), ep(2, 1)] },
        ControlMsg::GetMap { worker: 1, adopted: 2, min_epoch: 3, iteration: 4 },
        ControlMsg::Map(map),
        ControlMsg::Finished { role: Role::Worker, rank: 2 },
        ControlMsg::Status,
        ControlMsg::StatusJson,
        ControlMsg::StatusReport { text: "x".into() },
        ControlMsg::Ok,
        ControlMsg::Error { code: ErrorCode::Mismatch, message: "no".into() },
        ControlMsg::Once { id: (u64::MAX, 7), change: Box::new(ControlMsg::Cutover { shard: 2, at: 9 }) },
        ControlMsg::ShardReady { endpoint: ep(4, 2), keys },
        ControlMsg::Cutover { shard: 4, at: 99 },
        ControlMsg::TablesReady { rank: 1, tables: vec![ep(0, 1), ep(1, 1)] },
        ControlMsg::RowsOut { rank: 1, from: 4, to: 2, addr: 1 << 40, rkey: 7, len: 1 << 33 },
        ControlMsg::RowsTaken { rank: 2, from: 1, to: 4 },
        ControlMsg::StandInReady { rank: 2, from: 1, tables: vec![ep(0, 1)] },
        ControlMsg::StandInReady { rank: 2, from: 1, tables: Vec::new() },
        ControlMsg::RowsBackedUp { rank: 2, backup: 0 },
        ControlMsg::Released { shard: 4, bytes: 1 << 30, millis: 17 },
        ControlMsg::Scale { servers: 3 },
        ControlMsg::Poll { rank: 2, after: 5 },
        ControlMsg::ScaleWorkers { workers: 3 },
        ControlMsg::Vote { role: Role::Worker, rank: 1, id: 2, hold: 40 },
        ControlMsg::Expire { rank: 2 },
        ControlMsg::Split { shard: 3, at: 17, lo: ep(5, 1), hi: ep(6, 1) },
        ControlMsg::Declare {
            tensors: vec![
                crate::declare::TensorDecl { name: "fc.weight".into(), elements: 1 << 33, dtype: eps_agg::DType::Bf16 },
                crate::declare::TensorDecl { name: "fc.bias".into(), elements: 7, dtype: eps_agg::DType::Bf16 },
            ],
        },
        ControlMsg::GetSpec { rank: 2 },
        ControlMsg::Leave { rank: 1 },
        ControlMsg::Checkpoint { version: 0, dir: "/tmp/ck".into() },
        ControlMsg::Saved {
            version: 40,
            shard: 3,
            start: 4096,
            len: 1024,
            file: "/tmp/ck/ckpt-000000000040/shard-3-server-1.bin".into(),
            sha256: "ab".into(),
            missed: false,
        },
        ControlMsg::SavedRows {
            version: 40,
            table: 1,
            file: "/tmp/ck/ckpt-000000000030/table-1-server-0.bin".into(),
            sha256: "cd".into(),
            buckets: "0-99,2048".into(),
            changes: true,
            missed: false,
        },
        ControlMsg::Checkpointed { version: 40, path: "/tmp/ck/ckpt-000000000040".into() },
        ControlMsg::BackupReady { endpoint: ep(3, 1), keys },
        ControlMsg::BackupSynced { shard: 3, rank: 2 },
        ControlMsg::Unreplicated { shard: 3, rank: 1 },
        ControlMsg::ServerLost { rank: 2 },
        ControlMsg::Unreachable { rank: 1, by: Role::Worker, by_rank: 3 },
        ControlMsg::MoveStopped { shard: 7, rank: 2 },
        ControlMsg::Orders {
            last: 9,
            orders: vec![
                Order::MigrateIn { shard: 1, from: 0, start: 4096, len: 1024 },
                Order::Split { shard: 2, mid: 8192, lo: 7, hi: 8 },
                Order::Release { shard: 3 },
                Order::MigrateOut { shard: 1, to: 2, to_addr: "127.0.0.1:7".into(), keys },
                Order::Retire,
                Order::Propose { id: 4 },
                Order::Members { at: 30, workers: vec![0, 2], expired: vec![1] },
                Order::Checkpoint { version: 40, dir: "/tmp/ck".into() },
                Order::Buckets { at: 40, runs: vec![(0, 0), (1366, 2)] },
                Order::FetchRows { from: 1, to: 6, via: 5, from_addr: "127.0.0.1:9".into(), addr: 1 << 41, rkey: 3, len: 99 },
                Order::FreeRows { to: 2 },
                Order::BackupRows {
                    to: Some(RowsBackup { rank: 1, addr: "127.0.0.1:9".into(), inbox: vec![(1 << 40, 7), (1 << 41, 8)] }),
                },
                Order::BackupRows { to: None },
                Order::StandIn { from: 3, give: vec![1, 2], take: vec![4] },
                Order::Replicate { shard: 2, to: 1, to_addr: "127.0.0.1:8".into(), keys, snapshot: true },
                Order::AddBackup { shard: 2, from: 0, start: 4096, len: 512 },
                Order::Promote { shard: 2 },
                Order::Unreplicate { shard: 2 },
                Order::DropBackup { shard: 5 },
                Order::NoBackup { shard: 6 },
                Order::FreeLanding { shard: 6 },
            ],
        },
    ];
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for m in msgs {
        let f = m.encode();
        assert_eq!(u32::from_le_bytes(f[..4].try_into().unwrap()) as usize, f.len() - 4);
        assert_eq!(ControlMsg::decode(&f[4..]), Ok(m.clone()));
        // Every truncation fails cleanly.
        for cut in 0..f.len() - 4 {
            assert!(ControlMsg::decode(&f[4..4 + cut]).is_err());
        }
        // Mutated frames never panic; what decodes re-encodes to the same bytes.
        for _ in 0..2_000 {
            let mut b = f[4..].to_vec();
            for _ in 0..1 + next() % 3 {
                let i = (next() % b.len() as u64) as usize;
                b[i] = next() as u8;
            }
            if let Ok(d) = ControlMsg::decode(&b) {
                assert_eq!(&d.encode()[4..], &b[..], "{d:?}");
            }
        }
    }
    // Random bytes never panic.
    let mut x = 0x1234_5678_9abc_def0u64;
    for _ in 0..20_000 {
        let n = (x % 64) as usize;
        let mut b = Vec::with_capacity(n);
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.push(x as u8);
        }
        let _ = ControlMsg::decode(&b);
    }
}

fn route(owner: ShardEndpoint, previous: Option<(ShardEndpoint, u64)>) -> Route {
    Route { owner, previous, start: 0, len: 1024, from: 0, until: u64::MAX }
}

#[test]
fn routes_follow_the_cutover() {
    let r = route(ep(1, 3), Some((ep(1, 0), 12)));
    assert_eq!(r.for_iteration(11).owner, 0);
    assert_eq!(r.for_iteration(12).owner, 3);
    assert_eq!(route(ep(1, 3), None).for_iteration(0).owner, 3);
}

#[test]
fn splits_change_the_shards_of_an_iteration() {
    // Shard 0 split at iteration 5 into 2 and 3; shard 3 split at 9 into 4 and 5.
    let span = |id, start, len, from, until| Route { start, len, from, until, ..route(ep(id, 0), None) };
    let map = JobMap {
        epoch: 3,
        servers: Vec::new(),
        routes: vec![
            span(0, 0, 4096, 0, 5),
            span(1, 4096, 1024, 0, u64::MAX),
            span(2, 0, 2048, 5, u64::MAX),
            span(3, 2048, 2048, 5, 9),
            span(4, 2048, 1024, 9, u64::MAX),
            span(5, 3072, 1024, 9, u64::MAX),
        ],
        membership: Vec::new(),
        proposal: 0,
        tables: Vec::new(),
        buckets: Vec::new(),
        heirs: Vec::new(),
    };
    assert_eq!(map.shards_at(4), vec![0, 1]);
    assert_eq!(map.shards_at(5), vec![2, 3, 1]);
    assert_eq!(map.shards_at(9), vec![2, 4, 5, 1]);
    assert_eq!(map.covering(0, 4), vec![0]);
    assert_eq!(map.covering(0, 5), vec![2, 3]);
    assert_eq!(map.covering(0, 12), vec![2, 4, 5]);
    assert_eq!(map.covering(3, 9), vec![4, 5]);
    assert_eq!(map.covering(1, 9), vec![1]);
    assert!(map.covering(9, 0).is_empty());
}
