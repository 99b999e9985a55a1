use eps_agg::Optimizer;
use eps_proto::sync::PushOutcome;

use super::*;
use crate::batch::{dedup, split_by_owner};
use crate::bucket::initial_owners;
use crate::table::sum_duplicates;
use crate::{Init, RowOptimizer, TableSpec};

const DIM: usize = 3;

fn table(opt: RowOptimizer) -> Declared {
    Declared {
        name: "ids".into(),
        index: 0,
        spec: TableSpec { dim: DIM, opt, init: Init::Uniform { scale: 0.1 }, seed: 5, max_rows: 1 << 20 },
        lr: 0.05,
        key_limit: None,
        evict: None,
        max_keys: 1 << 16,
        dtype: eps_agg::DType::F32,
    }
}

/// A small deterministic generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = crate::bucket::mix(self.0.wrapping_add(0x9e37_79b9_7f4a_7c15));
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

/// One worker's batch: keys drawn from a small range (so workers and
/// positions share keys) and a gradient row per position.
fn batch(rng: &mut Rng, n: usize) -> (Vec<u64>, Vec<f32>) {
    let keys: Vec<u64> = (0..n).map(|_| rng.next() % 40).collect();
    let grads = (0..n * DIM).map(|_| rng.f32()).collect();
    (keys, grads)
}

/// BSP over `servers` parts with `workers` workers, each worker's batch
/// deduplicated, summed and split by owner as a worker does, every part
/// applying when its iteration is complete; against one table that merges
/// every row of the iteration in rank order.
fn bsp_equals_one_process(opt: RowOptimizer, servers: u32, workers: u32) {
    let owner = initial_owners(servers);
    let mut parts: Vec<TablePart> =
        (0..servers).map(|_| TablePart::new(table(opt), Consistency::Bsp, workers).unwrap()).collect();
    let mut reference = RowTable::new(table(opt).spec).unwrap();
    let mut rng = Rng(servers as u64 * 100 + workers as u64);
    let everyone: Vec<u32> = (0..workers).collect();
    for it in 0..12u64 {
        let batches: Vec<_> = (0..workers).map(|w| batch(&mut rng, 5 + w as usize * 7)).collect();
        // Each worker pulls its batch's rows at version `it`, as the reference holds them.
        for (keys, _) in &batches {
            let d = dedup(keys);
            let mut got = vec![0f32; d.keys.len() * DIM];
            for r in split_by_owner(&d.keys, &owner).unwrap() {
                let p = &mut parts[r.server as usize];
                let mut rows = vec![0f32; r.keys.len() * DIM];
                let v = p.sync.on_pull(0, it).unwrap().expect("version `it` is published");
                assert_eq!(v, it);
                p.answer(v, &r.keys, &mut rows).unwrap();
                for (i, row) in r.at.iter().zip(rows.chunks_exact(DIM)) {
                    got[*i as usize * DIM..(*i as usize + 1) * DIM].copy_from_slice(row);
                }
            }
            let mut want = vec![0f32; d.keys.len() * DIM];
            reference.pull(&d.keys, it, &mut want).unwrap();
            assert_eq!(got, want, "iteration {it}: pulled rows");
        }
        // Pushes: every worker sends every part its share (maybe no key).
        let mut landed: Vec<Vec<(Vec<u64>, Vec<f32>)>> = vec![Vec::new(); servers as usize];
        for (w, (keys, grads)) in batches.iter().enumerate() {
            let (k, g) = sum_duplicates(keys, grads, DIM).unwrap();
            let split = split_by_owner(&k, &owner).unwrap();
            for s in 0..servers {
                let (mut ks, mut gs) = (Vec::new(), Vec::new());
                if let Some(r) = split.iter().find(|r| r.server == s) {
                    ks = r.keys.clone();
                    for &i in &r.at {
                        gs.extend_from_slice(&g[i as usize * DIM..(i as usize + 1) * DIM]);
                    }
                }
                landed[s as usize].push((ks, gs));
                let out = parts[s as usize].sync.on_push(w as u32, it, &everyone).unwrap();
                let last = w as u32 == workers - 1;
                assert_eq!(out, if last { PushOutcome::AggregateAll { iteration: it } } else { PushOutcome::Wait });
            }
        }
        for (p, l) in parts.iter_mut().zip(&landed) {
            let c: Vec<(&[u64], &[f32])> = l.iter().map(|(k, g)| (&k[..], &g[..])).collect();
            assert_eq!(p.apply_all(&c).unwrap(), it + 1);
        }
        // The reference: each worker's duplicates summed in batch order, then
        // the workers' sums in rank order (f32 addition is not associative:
        // this is the order BSP defines).
        let own: Vec<_> = batches.iter().map(|(k, g)| sum_duplicates(k, g, DIM).unwrap()).collect();
        let all: Vec<(&[u64], &[f32])> = own.iter().map(|(k, g)| (&k[..], &g[..])).collect();
        let (k, mut g) = merge(&all, DIM).unwrap();
        g.iter_mut().for_each(|x| *x *= 1.0 / workers as f32);
        reference.push(&k, &g, 0.05, it).unwrap();
    }
    let held: usize = parts.iter().map(|p| p.rows().len()).sum();
    assert_eq!(held, reference.len(), "each row on one server");
    for p in &parts {
        for k in 0..40u64 {
            if let Some(r) = p.rows().row(k) {
                assert_eq!(Some(r), reference.row(k), "key {k}");
            }
        }
    }
}

#[test]
fn bsp_over_servers_is_bitwise_one_process_summing_in_rank_order() {
    let adam = RowOptimizer::Dense(Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false });
    let adagrad = RowOptimizer::Adagrad { eps: 1e-8, initial_accumulator: 0.1, weight_decay: 0.0 };
    for (servers, workers) in [(1, 1), (2, 3), (3, 4)] {
        bsp_equals_one_process(adam, servers, workers);
        bsp_equals_one_process(adagrad, servers, workers);
    }
}

#[test]
fn pulls_wait_for_their_version_and_refusals_change_nothing() {
    let sgd = RowOptimizer::Dense(Optimizer::Sgd { weight_decay: 0.0 });
    let mut p = TablePart::new(table(sgd), Consistency::Bsp, 2).unwrap();
    assert_eq!(p.sync.on_pull(1, 1).unwrap(), None, "version 1 is not there yet");
    let short = p.apply_all(&[(&[1, 2], &[0.0; DIM])]).unwrap_err();
    assert!(matches!(short, SparseError::Length { what: "gradient rows", .. }), "{short}");
    assert_eq!((p.rows().len(), p.sync.version()), (0, 0), "a refused update changes nothing");
    p.sync.on_push(0, 0, &[0, 1]).unwrap();
    assert_eq!(p.sync.on_push(1, 0, &[0, 1]).unwrap(), PushOutcome::AggregateAll { iteration: 0 });
    assert_eq!(p.apply_all(&[(&[9], &[1.0; DIM]), (&[], &[])]).unwrap(), 1);
    let mut ready = Vec::new();
    p.sync.ready_pulls(&mut ready);
    assert_eq!(ready, vec![(1, 1)]);
    let mut out = vec![0f32; DIM];
    assert!(p.answer(1, &[9, 10], &mut out).is_err(), "an answer buffer too small is refused");
    p.answer(1, &[9], &mut out).unwrap();
    let mut start = vec![0f32; DIM];
    Init::Uniform { scale: 0.1 }.fill(5, 9, &mut start);
    let want: Vec<f32> = start.iter().map(|x| x - 0.05 * (1.0 * 0.5)).collect();
    assert_eq!(out, want, "averaged over both contributors, one SGD step");
    assert_eq!(p.stats(), PartStats { pulled_keys: 1, stepped_keys: 1, evicted: 0, refused: 0 });
}

#[test]
fn asp_applies_each_worker_on_arrival_and_evicts_idle_rows() {
    let sgd = RowOptimizer::Dense(Optimizer::Sgd { weight_decay: 0.0 });
    let mut t = table(sgd);
    t.evict = Some(crate::decl::Evict { idle_steps: 2, min_touches: 0 });
    let mut p = TablePart::new(t, Consistency::Asp, 2).unwrap();
    assert_eq!(p.sync.on_push(1, 0, &[0, 1]).unwrap(), PushOutcome::ApplyOne { worker: 1, iteration: 0 });
    assert_eq!(p.apply_one(1, &[4], &[2.0; DIM]).unwrap(), 1);
    let mut out = vec![0f32; DIM];
    p.answer(1, &[4], &mut out).unwrap();
    let mut start = vec![0f32; DIM];
    Init::Uniform { scale: 0.1 }.fill(5, 4, &mut start);
    assert_eq!(out, start.iter().map(|x| x - 0.05 * (2.0 * 0.5)).collect::<Vec<_>>(), "scaled by the worker count");
    let mut clock = [0u64, 1];
    for it in 1..6 {
        let w = it % 2;
        p.sync.on_push(w as u32, clock[w], &[0, 1]).unwrap();
        clock[w] += 1;
        p.apply_one(w as u32, &[7], &[1.0; DIM]).unwrap();
    }
    assert!(p.rows().row(4).is_none() && p.rows().row(7).is_some(), "the idle row went, the busy one stayed");
    assert_eq!(p.stats().evicted, 1);
}
