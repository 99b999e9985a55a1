//! Sparse tables end to end, in one process: a control plane, servers and
//! workers on threads over the soft fabric on 127.0.0.1, a job with a dense
//! tensor and two sparse tables. BSP must equal one process stepping the
//! same rows (each worker's duplicates summed in batch order, the workers'
//! sums in rank order), and the dense parameters the dense reference, bit
//! for bit; bad input is refused with a clear error and changes nothing.

mod common;

use common::{reference, run_server, scale, start_control, step, worker_config};
use eps_proto::JobSpec;
use eps_proto::membership::Membership;
use eps_sparse::RowTable;
use eps_sparse::part::merge;
use eps_sparse::table::sum_duplicates;
use eps_worker::{Worker, WorkerError};

const KEYS: u64 = 300;

fn spec(workers: u32, servers: u32) -> String {
    format!(
        r#"
        [job]
        workers = {workers}
        servers = {servers}
        steps = 8
        shard_bytes = 8192
        seed = 7
        [model]
        tensors = [{{ name = "w", elements = 5000 }}]
        [[model.tables]]
        name = "ids"
        dim = 8
        optimizer = "adagrad"
        lr = 0.2
        max_keys = 512
        [[model.tables]]
        name = "cats"
        dim = 3
        key_limit = {KEYS}
        init = "zeros"
        [optimizer]
        kind = "adam"
        lr = 0.05
        "#
    )
}

/// Worker `rank`'s keys at iteration `t`: skewed towards small keys, with
/// repeats in a batch and keys shared between workers.
fn batch(rank: u32, t: u64, n: usize) -> Vec<u64> {
    (0..n as u64)
        .map(|i| {
            let x = eps_sparse::bucket::mix(u64::from(rank) << 40 ^ t << 20 ^ i);
            (x % KEYS) * (x >> 60) / 15
        })
        .collect()
}

/// The gradient rows a worker computes from the rows it pulled.
fn grads(rows: &[f32], rank: u32, t: u64) -> Vec<f32> {
    rows.iter().enumerate().map(|(i, r)| (r * 2.0 + rank as f32 * 0.3 + t as f32 * 0.1 + (i % 5) as f32 * 0.07).sin()).collect()
}

/// Pulls, then pushes, each table's rows of this step's batch.
fn sparse_step(w: &mut Worker, tables: &[(u16, usize)]) {
    let (rank, t) = (w.rank(), w.iteration());
    for &(id, dim) in tables {
        let keys = batch(rank, t, 40 + id as usize * 17);
        let mut rows = vec![0f32; keys.len() * dim];
        w.sparse_pull(id, &keys, &mut rows).unwrap();
        w.sparse_push(id, &keys, &grads(&rows, rank, t)).unwrap();
    }
}

/// Every key's row at the end, per table.
type Rows = Vec<Vec<f32>>;

/// Every key's row of each of `tables`, pulled.
fn all_rows(w: &mut Worker, tables: &[(u16, usize)]) -> Rows {
    let all: Vec<u64> = (0..KEYS).collect();
    let pull = |&(id, dim): &(u16, usize)| {
        let mut rows = vec![0f32; all.len() * dim];
        w.sparse_pull(id, &all, &mut rows).unwrap();
        rows
    };
    tables.iter().map(pull).collect()
}

/// Servers on detached threads (a worker that fails then fails the test at
/// once instead of leaving it waiting on servers that wait for it); their
/// summaries come back on the channel.
fn start_servers(n: u32, control: std::net::SocketAddr) -> std::sync::mpsc::Receiver<eps_server::ServerSummary> {
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..n {
        let tx = tx.clone();
        std::thread::spawn(move || {
            // (The test may have ended and dropped the receiver.)
            let _ = tx.send(run_server(control));
        });
    }
    rx
}

fn run(text: &str) -> (Vec<Vec<u8>>, Vec<Rows>, u64) {
    let (spec, control) = start_control(text);
    let servers = start_servers(spec.job.servers, control);
    let got: Vec<(Vec<u8>, Rows)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..spec.job.workers)
            .map(|_| {
                s.spawn(move || {
                    let mut w = Worker::join(&worker_config(control)).unwrap();
                    let tables: Vec<(u16, usize)> =
                        ["ids", "cats"].iter().map(|n| w.table(n).unwrap()).map(|i| (i, w.table_dim(i).unwrap())).collect();
                    let n = w.layout().total as usize;
                    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                    for _ in 0..w.spec().job.steps {
                        sparse_step(&mut w, &tables);
                        step(&mut w, &mut p, &mut g);
                    }
                    let end = all_rows(&mut w, &tables);
                    let out = w.params_copy();
                    w.finish().unwrap();
                    (out, end)
                })
            })
            .collect();
        workers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let timeout = std::time::Duration::from_secs(60);
    let rows_held = (0..spec.job.servers).map(|_| servers.recv_timeout(timeout).expect("a server's summary").sparse_rows).sum();
    let (dense, sparse) = got.into_iter().unzip();
    (dense, sparse, rows_held)
}

/// `v` as it arrives after travelling in `dtype` (rounded to it).
fn travelled(dtype: eps_agg::DType, v: &mut [f32]) {
    let mut bytes = vec![0u8; v.len() * dtype.size_bytes()];
    eps_agg::reduce::narrow(dtype, v, &mut bytes);
    v.fill(0.0);
    eps_agg::reduce::sum_serial(dtype, &[&bytes], v);
}

/// One process: each table's rows, stepped as BSP defines it, with the
/// contributors of each iteration `m` gives (rows and gradients rounded to
/// the table's dtype where they travel).
fn sparse_reference(text: &str, m: &Membership) -> Rows {
    let spec = JobSpec::from_toml(text).unwrap();
    let mut out = Vec::new();
    for (id, d) in eps_sparse::decl::tables(&spec).into_iter().enumerate() {
        let dim = d.spec.dim;
        let mut table = RowTable::new(d.spec).unwrap();
        for t in 0..spec.job.steps {
            let mut own = Vec::new();
            let set = m.contributors(t);
            for &rank in set {
                let keys = batch(rank, t, 40 + id * 17);
                let mut rows = vec![0f32; keys.len() * dim];
                table.pull(&keys, t, &mut rows).unwrap();
                travelled(d.dtype, &mut rows);
                let (k, mut g) = sum_duplicates(&keys, &grads(&rows, rank, t), dim).unwrap();
                travelled(d.dtype, &mut g);
                own.push((k, g));
            }
            let all: Vec<(&[u64], &[f32])> = own.iter().map(|(k, g)| (&k[..], &g[..])).collect();
            let (k, mut g) = merge(&all, dim).unwrap();
            g.iter_mut().for_each(|x| *x *= 1.0 / set.len() as f32);
            table.push(&k, &g, d.lr, t).unwrap();
        }
        let all: Vec<u64> = (0..KEYS).collect();
        let mut rows = vec![0f32; all.len() * dim];
        table.pull(&all, spec.job.steps, &mut rows).unwrap();
        travelled(d.dtype, &mut rows);
        out.push(rows);
    }
    out
}

#[test]
fn bsp_with_sparse_and_dense_equals_one_process() {
    for (workers, servers) in [(1, 1), (3, 2)] {
        let text = spec(workers, servers);
        let (dense, sparse, held) = run(&text);
        let m = Membership::new((0..workers).collect()).unwrap();
        let want_dense = reference(&text, &m);
        let want_sparse = sparse_reference(&text, &m);
        for r in 0..workers as usize {
            assert!(dense[r] == want_dense, "worker {r}: dense parameters differ ({workers} workers, {servers} servers)");
            for (i, (got, want)) in sparse[r].iter().zip(&want_sparse).enumerate() {
                assert!(got == want, "worker {r}: table {i} differs ({workers} workers, {servers} servers)");
            }
        }
        assert_eq!(held, 2 * KEYS, "every key of both tables is held once, after the last pull");
    }
}

/// Rows that travel as bf16 and f16: the servers keep f32 rows and state,
/// and BSP equals one process that rounds what travels (pulled rows, each
/// worker's summed gradient rows) to the table's dtype, bit for bit.
#[test]
fn rows_travelling_as_bf16_and_f16_equal_one_process_rounding_them_the_same() {
    let text = spec(3, 2)
        .replace("name = \"ids\"\n", "name = \"ids\"\ndtype = \"bf16\"\n")
        .replace("name = \"cats\"\n", "name = \"cats\"\ndtype = \"f16\"\n");
    let (_, sparse, _) = run(&text);
    let m = Membership::new(vec![0, 1, 2]).unwrap();
    let want = sparse_reference(&text, &m);
    let f32_text = spec(3, 2);
    let plain = sparse_reference(&f32_text, &m);
    assert!(want[0] != plain[0] && want[1] != plain[1], "rounding changes the rows (the test would see a missing one)");
    for (r, rows) in sparse.iter().enumerate() {
        for (i, (got, want)) in rows.iter().zip(&want).enumerate() {
            assert!(got == want, "worker {r}: table {i} differs from the rounded reference");
        }
    }
}

#[test]
fn bad_sparse_input_is_refused_and_changes_nothing() {
    let text = spec(1, 2);
    let (_, control) = start_control(&text);
    let _servers = start_servers(2, control);
    {
        let mut w = Worker::join(&worker_config(control)).unwrap();
        let err = |e: WorkerError| e.to_string();
        assert!(matches!(w.table("nope"), Err(WorkerError::UnknownTable(_))));
        let (ids, cats) = (w.table("ids").unwrap(), w.table("cats").unwrap());
        let mut before = vec![0f32; 3 * 3];
        w.sparse_pull(cats, &[1, 2, 3], &mut before).unwrap();
        let cases = [
            err(w.sparse_pull(cats, &[1, 2], &mut [0.0; 5]).unwrap_err()),
            err(w.sparse_pull(cats, &[1, KEYS], &mut [0.0; 6]).unwrap_err()),
            err(w.sparse_push(cats, &[1], &[0.5; 4]).unwrap_err()),
            err(w.sparse_push(cats, &[KEYS + 5], &[0.5; 3]).unwrap_err()),
            err(w.sparse_pull(ids, &(0..513).collect::<Vec<u64>>(), &mut vec![0.0; 513 * 8]).unwrap_err()),
            err(w.sparse_pull(7, &[1], &mut [0.0; 3]).unwrap_err()),
        ];
        let wants = [
            "expected 6 elements, got 5",
            "not below the table's key_limit 300",
            "expected 3 elements, got 4",
            "key 305 is not below",
            "513 distinct keys in one call; the table's max_keys is 512",
            "unknown sparse table \"#7 (the job has 2 tables)\"",
        ];
        for (got, want) in cases.iter().zip(wants) {
            assert!(got.contains(want), "{got:?} should say {want:?}");
        }
        w.sparse_push(cats, &[1, 1], &[1.0; 6]).unwrap();
        let twice = err(w.sparse_push(cats, &[2], &[1.0; 3]).unwrap_err());
        assert!(twice.contains("cats") && twice.contains("pushed twice"), "{twice}");
        let n = w.layout().total as usize;
        let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
        step(&mut w, &mut p, &mut g);
        let mut after = vec![0f32; 3 * 3];
        w.sparse_pull(cats, &[1, 2, 3], &mut after).unwrap();
        assert_ne!(after[..3], before[..3], "key 1 was stepped");
        assert_eq!(after[3..], before[3..], "keys 2 and 3 were not: the refused calls sent nothing");
        for _ in 1..w.spec().job.steps {
            step(&mut w, &mut p, &mut g);
        }
        w.finish().unwrap();
    }
}

/// SSP and ASP apply each worker's push on arrival (scaled by the worker
/// count, as dense shards do): once both workers' pushes are applied, every
/// row holds the sum of all of them, whatever the order they came in.
#[test]
fn ssp_and_asp_apply_every_push_on_arrival() {
    for consistency in ["ssp", "asp"] {
        let dir = std::env::temp_dir().join(format!("eps-sparse-cut-{consistency}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let text = format!(
            "[job]\nworkers = 2\nservers = 2\nsteps = 6\nconsistency = \"{consistency}\"\nstaleness = 1\nseed = 3\n\
             checkpoint_every = 3\ncheckpoint_dir = {:?}\n\
             [model]\ntensors = [{{ name = \"w\", elements = 4096 }}]\n\
             [[model.tables]]\nname = \"t\"\ndim = 2\noptimizer = \"sgd\"\nlr = 0.25\ninit = \"zeros\"\n\
             [optimizer]\nkind = \"sgd\"\nlr = 0.01\n",
            dir.display().to_string()
        );
        let (spec, control) = start_control(&text);
        let servers = start_servers(2, control);
        let both = std::sync::Barrier::new(2);
        let rows: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut w = Worker::join(&worker_config(control)).unwrap();
                        let n = w.layout().total as usize;
                        let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                        let mut pulled = vec![0f32; 2 * 10];
                        for _ in 0..spec.job.steps {
                            let (r, t) = (u64::from(w.rank()), w.iteration());
                            w.sparse_pull(0, &(0..10).collect::<Vec<u64>>(), &mut pulled).unwrap();
                            let keys: Vec<u64> = (0..10).map(|k| (k + r + t) % 10).collect();
                            let grads: Vec<f32> = keys.iter().flat_map(|&k| [k as f32, 1.0 + r as f32]).collect();
                            w.sparse_push(0, &keys, &grads).unwrap();
                            step(&mut w, &mut p, &mut g);
                        }
                        w.sparse_flush(0).unwrap();
                        both.wait();
                        let mut end = vec![0f32; 2 * 10];
                        w.sparse_pull(0, &(0..10).collect::<Vec<u64>>(), &mut end).unwrap();
                        w.finish().unwrap();
                        end
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Each worker pushed every key once a step: key k's first value got
        // k, its second 1 + rank, each scaled by 1/2, at lr 0.25.
        let steps = spec.job.steps as f32;
        for k in 0..10usize {
            let want = [-0.25 * 0.5 * (2.0 * steps * k as f32), -0.25 * 0.5 * steps * (1.0 + 2.0)];
            for got in &rows {
                let row = &got[2 * k..2 * k + 2];
                assert!(
                    (row[0] - want[0]).abs() < 1e-4 && (row[1] - want[1]).abs() < 1e-4,
                    "{consistency}: key {k}: {row:?}, want {want:?}"
                );
            }
        }
        // The checkpoint at 3 is a cut: the table holds exactly the pushes of
        // iterations 0..3 of both workers, though they ran one apart.
        for _ in 0..2 {
            servers.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
        }
        let saved = rows_at(&dir, 3);
        for k in 0..10u64 {
            let want = [-0.25 * 0.5 * (2.0 * 3.0 * k as f32), -0.25 * 0.5 * 3.0 * (1.0 + 2.0)];
            let row = &saved[&k];
            assert!(
                (row[0] - want[0]).abs() < 1e-4 && (row[1] - want[1]).abs() < 1e-4,
                "{consistency}: saved key {k}: {row:?}, want {want:?}"
            );
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// The rows (values and state, by key) of table 0 in the checkpoint at
/// `version` in `dir`: each bucket's whole file, then its changes.
fn rows_at(dir: &std::path::Path, version: u64) -> std::collections::HashMap<u64, Vec<f32>> {
    use eps_proto::checkpoint::{MANIFEST, Manifest, RowsHeader, dir_name, parse_runs};
    let ckpt = dir.join(dir_name(version));
    let m = Manifest::from_toml(&std::fs::read_to_string(ckpt.join(MANIFEST)).unwrap()).unwrap();
    let mut entries = m.rows.clone();
    entries.sort_by_key(|e| e.version(m.version));
    let mut rows = std::collections::HashMap::new();
    let key = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().unwrap());
    for e in entries {
        let buckets = parse_runs(&e.buckets).unwrap();
        let mine = |k: u64| buckets.contains(&eps_proto::buckets::bucket_of(k));
        let bytes = std::fs::read(ckpt.join(&e.file)).unwrap();
        let h = RowsHeader::decode(&bytes).unwrap();
        let rec = eps_sparse::moves::ROW_META + 4 * h.stride as usize;
        let split = eps_proto::checkpoint::PIECE_HEADER + h.rows as usize * rec;
        for k in bytes[split..].chunks_exact(8).map(key).filter(|&k| e.changes && mine(k)) {
            rows.remove(&k);
        }
        for r in bytes[eps_proto::checkpoint::PIECE_HEADER..split].chunks_exact(rec).filter(|r| mine(key(r))) {
            let values = r[eps_sparse::moves::ROW_META..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()));
            rows.insert(key(r), values.collect());
        }
    }
    rows
}

/// Rows not touched for `evict_idle_steps` are evicted (the servers count
/// them), and an evicted key comes back as its initial row.
#[test]
fn idle_rows_are_evicted_and_come_back_fresh() {
    let text = "[job]\nworkers = 1\nservers = 2\nsteps = 12\n[model]\ntensors = [{ name = \"w\", elements = 4096 }]\n\
                [[model.tables]]\nname = \"t\"\ndim = 3\noptimizer = \"sgd\"\nlr = 0.5\nevict_idle_steps = 3\n\
                [optimizer]\nkind = \"sgd\"\nlr = 0.01\n";
    let (spec, control) = start_control(text);
    let servers = start_servers(2, control);
    let mut w = Worker::join(&worker_config(control)).unwrap();
    let n = w.layout().total as usize;
    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
    let (mut first, mut rows) = (vec![0f32; 3 * 8], vec![0f32; 3 * 8]);
    let early: Vec<u64> = (0..8).collect();
    w.sparse_pull(0, &early, &mut first).unwrap();
    for _ in 0..spec.job.steps {
        // Keys 0..8 in the first two steps only; 100.. every step.
        let t = w.iteration();
        let keys: Vec<u64> = if t < 2 { (0..8).chain(100..104).collect() } else { (100..104).collect() };
        w.sparse_push(0, &keys, &vec![1.0; keys.len() * 3]).unwrap();
        step(&mut w, &mut p, &mut g);
    }
    w.sparse_pull(0, &early, &mut rows).unwrap();
    assert_eq!(rows, first, "evicted rows come back as their initial values, not as the stepped ones");
    w.finish().unwrap();
    let timeout = std::time::Duration::from_secs(60);
    let evicted: u64 = (0..2).map(|_| servers.recv_timeout(timeout).expect("a server's summary").sparse_evicted).sum();
    assert_eq!(evicted, 8, "keys 0..8 were idle for more than 3 steps");
}

/// Asks the control plane for `workers` workers (again while another change
/// is in progress).
fn scale_workers(control: std::net::SocketAddr, workers: u32) {
    scale(control, eps_proto::control::ControlMsg::ScaleWorkers { workers });
}

/// A worker joins and later leaves while the job trains: the tables and the
/// dense tensor end as one process computes them with the contributor sets
/// the run reports (each iteration averaged over its own contributors).
#[test]
fn workers_joining_and_leaving_equal_the_reference_with_the_same_contributor_sets() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let text = spec(2, 2).replace("steps = 8", "steps = 40").replace("[job]", "[job]\nmax_workers = 3");
    let (spec, control) = start_control(&text);
    let _servers = start_servers(spec.job.servers, control);
    let progress = AtomicU64::new(0);
    let wait_for = |i: u64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while progress.load(Ordering::Acquire) < i {
            assert!(std::time::Instant::now() < deadline, "training stalled before iteration {i}");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    let train = || {
        let mut w = Worker::join(&worker_config(control)).unwrap();
        let tables: Vec<(u16, usize)> =
            ["ids", "cats"].iter().map(|n| w.table(n).unwrap()).map(|i| (i, w.table_dim(i).unwrap())).collect();
        let n = w.layout().total as usize;
        let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
        while w.iteration() < w.spec().job.steps {
            if !w.begin().unwrap() {
                w.finish().unwrap();
                return None; // it left
            }
            sparse_step(&mut w, &tables);
            step(&mut w, &mut p, &mut g);
            if w.rank() == 0 {
                progress.fetch_max(w.iteration(), Ordering::AcqRel);
            }
        }
        let out = (w.membership().clone(), w.params_copy(), all_rows(&mut w, &tables));
        w.finish().unwrap();
        Some(out)
    };
    let got = std::thread::scope(|s| {
        let first: Vec<_> = (0..2).map(|_| s.spawn(train)).collect();
        wait_for(5);
        scale_workers(control, 3);
        let joiner = s.spawn(train);
        wait_for(20);
        scale_workers(control, 2);
        assert!(joiner.join().unwrap().is_none(), "the joiner (the highest rank) leaves");
        first.into_iter().map(|h| h.join().unwrap().expect("ranks 0 and 1 train to the end")).collect::<Vec<_>>()
    });
    let m = got[0].0.clone();
    let sets: Vec<&[u32]> = m.epochs().iter().map(|(_, s)| &s[..]).collect();
    assert_eq!(sets, [&[0, 1][..], &[0, 1, 2], &[0, 1]], "{:?}", m.epochs());
    let (want_dense, want_sparse) = (reference(&text, &m), sparse_reference(&text, &m));
    for (r, (_, dense, sparse)) in got.iter().enumerate() {
        assert!(*dense == want_dense, "worker {r}: dense parameters differ ({:?})", m.epochs());
        for (i, (got, want)) in sparse.iter().zip(&want_sparse).enumerate() {
            assert!(got == want, "worker {r}: table {i} differs ({:?})", m.epochs());
        }
    }
}

/// SSP and ASP: servers added and removed while the job trains move buckets
/// (a source takes its rows out once every worker's pushes before the
/// cutover are applied; the target holds pushes of the cutover and pulls of
/// incoming keys until they are in). Every push is applied exactly once:
/// each key ends at what every worker's pushes add up to, exactly.
#[test]
fn ssp_and_asp_bucket_moves_apply_every_push_exactly_once() {
    use std::sync::atomic::{AtomicU64, Ordering};
    const STEPS: u64 = 60;
    const N: u64 = 64;
    for consistency in ["ssp", "asp"] {
        let text = format!(
            "[job]\nworkers = 2\nservers = 2\nsteps = {STEPS}\nconsistency = \"{consistency}\"\nstaleness = 2\nseed = 3\n\
             [model]\ntensors = [{{ name = \"w\", elements = 4096 }}]\n\
             [[model.tables]]\nname = \"t\"\ndim = 2\noptimizer = \"sgd\"\nlr = 0.25\ninit = \"zeros\"\n\
             [optimizer]\nkind = \"sgd\"\nlr = 0.01\n"
        );
        let (spec, control) = start_control(&text);
        let servers = start_servers(2, control);
        let progress = AtomicU64::new(0);
        let both = std::sync::Barrier::new(2);
        let keys: Vec<u64> = (0..N).map(|k| k * 7919).collect();
        let rows: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut w = Worker::join(&worker_config(control)).unwrap();
                        let n = w.layout().total as usize;
                        let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                        let mut pulled = vec![0f32; 2 * keys.len()];
                        for _ in 0..spec.job.steps {
                            let r = w.rank() as f32;
                            w.sparse_pull(0, &keys, &mut pulled).unwrap();
                            let grads: Vec<f32> = keys.iter().enumerate().flat_map(|(i, _)| [(i % 4) as f32, 1.0 + r]).collect();
                            w.sparse_push(0, &keys, &grads).unwrap();
                            step(&mut w, &mut p, &mut g);
                            progress.fetch_max(w.iteration(), Ordering::AcqRel);
                            // (Slow enough that the moves happen while it trains.)
                            std::thread::sleep(std::time::Duration::from_millis(3));
                        }
                        w.sparse_flush(0).unwrap();
                        both.wait();
                        let mut end = vec![0f32; 2 * keys.len()];
                        w.sparse_pull(0, &keys, &mut end).unwrap();
                        w.finish().unwrap();
                        end
                    })
                })
                .collect();
            let wait_for = |i: u64| {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
                while progress.load(Ordering::Acquire) < i {
                    assert!(std::time::Instant::now() < deadline, "{consistency}: training stalled before iteration {i}");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            };
            use eps_proto::control::ControlMsg;
            wait_for(10);
            scale(control, ControlMsg::Scale { servers: 3 });
            let added = s.spawn(move || run_server(control));
            wait_for(30);
            scale(control, ControlMsg::Scale { servers: 1 });
            let rows = hs.into_iter().map(|h| h.join().unwrap()).collect();
            let added = added.join().unwrap();
            assert!(added.sparse_rows_in > 0, "{consistency}: the added server took rows in");
            rows
        });
        let summaries: Vec<eps_server::ServerSummary> =
            (0..2).map(|_| servers.recv_timeout(std::time::Duration::from_secs(60)).expect("a server's summary")).collect();
        assert!(summaries.iter().map(|s| s.sparse_rows_out).sum::<u64>() > 0, "{consistency}: rows moved");
        // Each worker pushed every key once a step, each push scaled by 1/2,
        // at lr 0.25: key i's first value got i % 4 from both, its second
        // 1 + rank.
        let steps = STEPS as f32;
        for i in 0..N as usize {
            let want = [-0.25 * 0.5 * (2.0 * steps * (i % 4) as f32), -0.25 * 0.5 * steps * (1.0 + 2.0)];
            for got in &rows {
                assert_eq!(&got[2 * i..2 * i + 2], &want[..], "{consistency}: key {}", keys[i]);
            }
        }
    }
}

/// A round whose parameters all came in ends when the next iteration's
/// first push opens a round, even if its pull was never asked for: the
/// tables not pushed in it are pushed (empty) then, as a pull would have, so
/// that no table misses an iteration. (They once did: the table's next
/// push then waited on its server for ever, and a worker's request test, a
/// call that must not wait, waited for its credit until the timeout.)
#[test]
fn rounds_ended_without_a_pull_still_push_every_table() {
    let text = spec(1, 1);
    let (_, control) = start_control(&text);
    let _servers = start_servers(1, control);
    let mut cfg = worker_config(control);
    cfg.timeout = std::time::Duration::from_secs(5);
    let mut w = Worker::join(&cfg).unwrap();
    let (ids, cats) = (w.table("ids").unwrap(), w.table("cats").unwrap());
    let all: Vec<usize> = (0..w.tensor_count()).collect();
    for t in 0..3u64 {
        assert_eq!(w.iteration(), t);
        // Only `cats` is pushed; the pull is never asked for.
        w.sparse_push(cats, &[1, 2], &[0.5; 6]).unwrap();
        w.push_tensors(&all).unwrap();
        // The next iteration's first push (of nothing) ends this round once
        // its answers are in.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while w.iteration() == t {
            assert!(std::time::Instant::now() < deadline, "iteration {t}'s answers did not come");
            std::thread::sleep(std::time::Duration::from_millis(5));
            // (Testing the pushes takes in what arrived, answers included.)
            w.pushes_sent(&all).unwrap();
            w.push_tensors(&[]).unwrap();
        }
    }
    // Every table still moves on: a pull of `ids` and a full round work.
    let mut rows = vec![0f32; 8];
    w.sparse_pull(ids, &[3], &mut rows).unwrap();
    w.sparse_flush(cats).unwrap();
    w.push_pull().unwrap();
    w.sparse_flush(ids).unwrap();
    let steps = w.spec().job.steps;
    let n = w.layout().total as usize;
    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
    while w.iteration() < steps {
        step(&mut w, &mut p, &mut g);
    }
    w.finish().unwrap();
}
