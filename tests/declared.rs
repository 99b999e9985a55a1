//! Jobs whose tensors the workers declare when they join (`model.declare`), as a
//! framework's do, and the server-side optimizer `none` (servers publish the
//! averaged gradient). In one process: a control plane, servers and workers on
//! threads over the soft fabric on 127.0.0.1.

mod common;

use common::{reference, run_server, spec_text, start_control, step, worker_config};
use eps_agg::DType;
use eps_fabric::prelude::*;
use eps_proto::declare::TensorDecl;
use eps_proto::membership::Membership;
use eps_worker::{Worker, WorkerError, register_declaring};

/// The tensors of `common::spec_text`'s model, as a worker declares them.
fn decl(dtype: DType) -> Vec<TensorDecl> {
    vec![TensorDecl { name: "w".into(), elements: 20000, dtype }, TensorDecl { name: "b".into(), elements: 1001, dtype }]
}

/// `common::spec_text` with the tensors left to the workers.
fn declared_text(workers: u32, servers: u32, steps: u64, dtype: &str, opt: &str) -> (String, String) {
    let explicit = spec_text(workers, servers, steps, dtype, opt, "bsp");
    let line = explicit.lines().find(|l| l.contains("tensors =")).unwrap().to_string();
    (explicit.replace(&line, "declare = true"), explicit)
}

fn join(control: std::net::SocketAddr, d: &[TensorDecl]) -> Result<Worker, WorkerError> {
    let cfg = worker_config(control);
    let reg = register_declaring(&cfg, Some(d))?;
    Worker::join_on(&cfg, reg, SoftDevice::open()?.alloc_pd())
}

/// Servers start before any worker (they wait for the declaration); the
/// first worker's declaration fixes the layout; the run equals the
/// single-process reference of the job whose spec names the same tensors.
fn declared_run_equals_reference(dtype: DType, opt: &str) {
    let (text, explicit) = declared_text(2, 2, 5, dtype.name(), opt);
    let (spec, control) = start_control(&text);
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || run_server(control));
        }
        // Servers register (and wait) before the first declaration.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let workers: Vec<_> = (0..spec.job.workers)
            .map(|_| {
                s.spawn(move || {
                    let mut w = join(control, &decl(dtype)).unwrap();
                    assert_eq!(w.tensor("b").unwrap(), 20000..21001);
                    let n = w.layout().total as usize;
                    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                    for _ in 0..w.spec().job.steps {
                        step(&mut w, &mut p, &mut g);
                    }
                    let out = w.params_copy();
                    w.finish().unwrap();
                    out
                })
            })
            .collect();
        workers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want = reference(&explicit, &Membership::new(vec![0, 1]).unwrap());
    for (r, g) in got.iter().enumerate() {
        assert!(g == &want, "worker {r} differs from the reference ({}, {opt})", dtype.name());
    }
}

#[test]
fn declared_tensors_train_as_a_spec_that_names_them() {
    declared_run_equals_reference(DType::F32, "adam");
    declared_run_equals_reference(DType::Bf16, "momentum");
}

#[test]
fn optimizer_none_publishes_the_averaged_gradient() {
    declared_run_equals_reference(DType::F32, "none");
    // And in words: after a step, the parameters are the mean of the gradients.
    let (text, _) = declared_text(2, 1, 2, "f32", "none");
    let (_, control) = start_control(&text);
    std::thread::scope(|s| {
        s.spawn(move || run_server(control));
        let hs: Vec<_> = (0..2u32)
            .map(|_| {
                s.spawn(move || {
                    let mut w = join(control, &decl(DType::F32)).unwrap();
                    let r = w.rank() as f32;
                    for t in 0..2u64 {
                        let g = w.grads_f32_mut().unwrap();
                        for (i, x) in g.iter_mut().enumerate() {
                            *x = r + i as f32 + t as f32;
                        }
                        w.push_pull().unwrap();
                        // Ranks 0 and 1: the mean is i + t + 0.5.
                        let mut p = vec![0f32; w.layout().total as usize];
                        w.read_params(&mut p).unwrap();
                        for (i, x) in p.iter().enumerate() {
                            assert_eq!(*x, i as f32 + t as f32 + 0.5, "element {i} at iteration {t}");
                        }
                    }
                    w.finish().unwrap();
                })
            })
            .collect();
        hs.into_iter().for_each(|h| h.join().unwrap());
    });
}

#[test]
fn a_different_declaration_is_refused_with_its_first_difference_and_takes_no_rank() {
    let (text, _) = declared_text(1, 1, 2, "f32", "sgd");
    let (_, control) = start_control(&text);
    std::thread::scope(|s| {
        s.spawn(move || run_server(control));
        // Before any declaration, a worker that declares nothing cannot join.
        let e = join_undeclared(control).unwrap_err();
        assert!(e.to_string().contains("declare"), "{e}");
        let (joined_tx, joined) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel::<()>();
        let first = s.spawn(move || {
            let mut w = join(control, &decl(DType::F32)).unwrap();
            joined_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            w.push_pull().unwrap();
            w.push_pull().unwrap();
            w.finish().unwrap();
        });
        // Once the first declaration is in, differing ones are refused.
        joined.recv().unwrap();
        let cases: [(Vec<TensorDecl>, &str); 4] = [
            (vec![decl(DType::F32)[0].clone()], "tensor \"b\" is missing"),
            (vec![decl(DType::F32)[1].clone(), decl(DType::F32)[0].clone()], "tensor 0 is \"w\" in the job but \"b\""),
            (decl(DType::Bf16), "is f32 in the job but bf16"),
            (
                vec![decl(DType::F32)[0].clone(), TensorDecl { name: "b".into(), elements: 1000, dtype: DType::F32 }],
                "has 1001 elements in the job but 1000",
            ),
        ];
        for (d, want) in cases {
            let e = join(control, &d).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        // The one worker the job has was never displaced by the refused ones.
        go.send(()).unwrap();
        first.join().unwrap();
    });
}

fn join_undeclared(control: std::net::SocketAddr) -> Result<Worker, WorkerError> {
    let cfg = worker_config(control);
    let reg = eps_worker::register(&cfg)?;
    Worker::join_on(&cfg, reg, SoftDevice::open()?.alloc_pd())
}

/// A framework pushes tensors as its backward pass produces them (last layer
/// first) and polls for their parameters: the result is the same bits as
/// whole push_pulls, and a tensor whose shard also holds an unpushed tensor
/// is not pulled before that one is pushed.
#[test]
fn tensor_by_tensor_pushes_equal_whole_push_pulls() {
    let (text, explicit) = declared_text(2, 2, 5, "f32", "adam");
    let (spec, control) = start_control(&text);
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || run_server(control));
        }
        let hs: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    let mut w = join(control, &decl(DType::F32)).unwrap();
                    let n = w.layout().total as usize;
                    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                    for _ in 0..w.spec().job.steps - 1 {
                        w.read_params(&mut p).unwrap();
                        common::gradient(&p, w.rank(), w.iteration(), &mut g);
                        w.write_grads(&g).unwrap();
                        let t = w.iteration();
                        // "b" (index 1) first: its first shard also holds the end of "w".
                        w.push_tensors(&[1]).unwrap();
                        assert!(w.in_round());
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        assert!(!w.test_pull(&[1]).unwrap(), "b's first shard cannot be answered before w is pushed");
                        let e = w.push_tensors(&[1]).unwrap_err();
                        assert!(e.to_string().contains("twice"), "{e}");
                        w.push_tensors(&[0]).unwrap();
                        while !w.pushes_sent(&[0, 1]).unwrap() {
                            std::thread::yield_now();
                        }
                        while !w.test_pull(&[1]).unwrap() {
                            std::thread::yield_now();
                        }
                        w.pull_tensors(&[0, 1]).unwrap();
                        assert!(!w.in_round());
                        assert_eq!(w.iteration(), t + 1);
                    }
                    // No round open: nothing in flight, the parameters are in.
                    assert!(w.test_pull(&[0]).unwrap());
                    w.read_params(&mut p).unwrap();
                    common::gradient(&p, w.rank(), w.iteration(), &mut g);
                    w.write_grads(&g).unwrap();
                    w.push_tensors(&[0]).unwrap();
                    let e = w.pull_tensors(&[1]).unwrap_err();
                    assert!(e.to_string().contains("not pushed in this iteration"), "{e}");
                    w.push_tensors(&[1]).unwrap();
                    w.pull_tensors(&[0, 1]).unwrap();
                    let e = w.push_tensors(&[2]).unwrap_err();
                    assert!(e.to_string().contains("tensor index"), "{e}");
                    let out = w.params_copy();
                    w.finish().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let want = reference(&explicit, &Membership::new(vec![0, 1]).unwrap());
    for (r, g) in got.iter().enumerate() {
        assert!(g == &want, "worker {r} differs from the reference");
    }
}

/// `model.init = "worker"` (the default here): the first worker's values are
/// every worker's first pull; a rank 0 removed before it sent them leaves
/// the servers' initialiser, and the job goes on.
#[test]
fn the_first_workers_values_seed_the_job_and_its_loss_falls_back_to_the_servers() {
    let mine = |k: u32| -> Vec<u8> {
        let n = decl(DType::F32).iter().map(|t| t.elements).sum::<u64>();
        (0..n).flat_map(|i| (i as f32 * 0.5 + k as f32).to_le_bytes()).collect()
    };
    let run = |rank0_joins: bool| -> Vec<Vec<u8>> {
        let (text, _) = declared_text(2, 2, 3, "f32", "sgd");
        let text = text.replace("[job]", "[job]\nworker_lease_ms = 1000");
        let (spec, control) = start_control(&text);
        let first = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..spec.job.servers {
                s.spawn(move || run_server(control));
            }
            let cfg = worker_config(control);
            let reg = register_declaring(&cfg, Some(&decl(DType::F32))).unwrap().with_initial(mine(0)).unwrap();
            assert_eq!(reg.rank(), 0);
            let zero = s.spawn(move || {
                if rank0_joins {
                    train_from(Worker::join_on(&cfg, reg, SoftDevice::open().unwrap().alloc_pd()).unwrap())
                } else {
                    // Registered, never joined: its lease lapses.
                    drop(reg);
                    Vec::new()
                }
            });
            let cfg = worker_config(control);
            let reg = register_declaring(&cfg, Some(&decl(DType::F32))).unwrap().with_initial(mine(1)).unwrap();
            let w = Worker::join_on(&cfg, reg, SoftDevice::open().unwrap().alloc_pd()).unwrap();
            first.lock().unwrap().push(w.params_copy());
            train_from(w);
            zero.join().unwrap();
        });
        first.into_inner().unwrap()
    };
    let got = run(true);
    assert!(got[0] == mine(0), "rank 1's first pull is rank 0's initial values");
    let got = run(false);
    let seed = 7; // `common::spec_text`'s job.seed
    let servers: Vec<u8> = (0..21001u64).flat_map(|i| eps_proto::init::param(seed, i).to_le_bytes()).collect();
    assert!(got[0] == servers, "without rank 0's values: the servers' initialiser");
}

/// Trains `w` to the job's end; its last parameters.
fn train_from(mut w: Worker) -> Vec<u8> {
    let n = w.layout().total as usize;
    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
    while w.iteration() < w.spec().job.steps {
        step(&mut w, &mut p, &mut g);
    }
    let out = w.params_copy();
    w.finish().unwrap();
    out
}
