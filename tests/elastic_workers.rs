//! Workers joining and leaving a running BSP job (cluster on threads, soft fabric
//! on 127.0.0.1): the result is bitwise the single-process reference computed with
//! the same contributor set per iteration, and a worker that vanishes is removed
//! when its lease runs out instead of stalling the job.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{reference, run_server, secret, start_control, step, worker_config};
use eps_control::{ControlClient, ControlError};
use eps_proto::control::ControlMsg;
use eps_proto::membership::Membership;
use eps_worker::Worker;

/// What a worker thread ends with.
struct Outcome {
    rank: u32,
    membership: Membership,
    /// Final parameters, for a worker that trained to the last step.
    params: Option<Vec<u8>>,
}

/// Trains until the last step, or until the job says this worker left; `after`
/// is called with the iteration reached after every step.
fn train(control: SocketAddr, after: &dyn Fn(u32, u64)) -> Outcome {
    let mut w = Worker::join(&worker_config(control)).unwrap();
    let n = w.layout().total as usize;
    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
    let steps = w.spec().job.steps;
    if w.iteration() >= steps {
        // Admitted after the last step: nothing to train, nothing pulled.
        let out = Outcome { rank: w.rank(), membership: w.membership().clone(), params: None };
        w.finish().unwrap();
        return out;
    }
    while w.iteration() < steps {
        if !w.begin().unwrap() {
            let membership = w.membership().clone();
            let rank = w.rank();
            w.finish().unwrap();
            return Outcome { rank, membership, params: None };
        }
        step(&mut w, &mut p, &mut g);
        after(w.rank(), w.iteration());
    }
    let out = Outcome { rank: w.rank(), membership: w.membership().clone(), params: Some(w.params_copy()) };
    w.finish().unwrap();
    out
}

/// Asks for `workers` workers, retrying while an earlier change is under way.
fn scale_workers(control: SocketAddr, workers: u32) {
    let mut c = ControlClient::connect(control, &secret(), Duration::from_secs(10)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match c.call(&ControlMsg::ScaleWorkers { workers }) {
            Ok(_) => return,
            Err(e @ ControlError::Rejected(_)) if e.is_temporary() && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("scale to {workers} workers: {e}"),
        }
    }
}

fn status(control: SocketAddr) -> String {
    let mut c = ControlClient::connect(control, &secret(), Duration::from_secs(10)).unwrap();
    match c.call(&ControlMsg::Status).unwrap() {
        ControlMsg::StatusReport { text } => text,
        m => panic!("{m:?}"),
    }
}

fn wait_for(progress: &AtomicU64, iteration: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while progress.load(Ordering::Acquire) < iteration {
        assert!(Instant::now() < deadline, "training stalled before iteration {iteration}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn joins_and_leaves_equal_the_reference_with_the_same_contributor_sets() {
    for (dtype, opt) in [("f32", "adam"), ("bf16", "momentum")] {
        // Room after the requests: a change takes effect some iterations
        // after it is asked (its votes come with the workers' long polls), and
        // at a fast step rate that is many.
        const STEPS: u64 = 48;
        let text = common::spec_text(2, 2, STEPS, dtype, opt, "bsp").replace("[job]", "[job]\nmax_workers = 4");
        let (spec, control) = start_control(&text);
        let progress = AtomicU64::new(0);
        let note = |rank: u32, t: u64| {
            if rank == 0 {
                progress.store(t, Ordering::Release);
            }
        };
        let outcomes: Vec<Outcome> = std::thread::scope(|s| {
            for _ in 0..spec.job.servers {
                s.spawn(move || run_server(control));
            }
            let mut hs: Vec<_> = (0..2).map(|_| s.spawn(|| train(control, &note))).collect();
            // 2 -> 3 (rank 2 joins), 3 -> 2 (rank 2 leaves), 2 -> 3 (rank 3 joins).
            wait_for(&progress, 3);
            scale_workers(control, 3);
            hs.push(s.spawn(|| train(control, &note)));
            wait_for(&progress, 8);
            // `eps status` shows the progress (as of the workers' last long poll)
            // and the contributor set.
            let text = status(control);
            let it: u64 = text
                .lines()
                .find_map(|l| l.strip_prefix("iteration: "))
                .and_then(|l| l.split(' ').next())
                .unwrap()
                .parse()
                .unwrap();
            assert!((1..=STEPS).contains(&it) && text.contains("contributing [0, 1, 2]"), "{text}");
            scale_workers(control, 2);
            wait_for(&progress, 11);
            scale_workers(control, 3);
            hs.push(s.spawn(|| train(control, &note)));
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let m = outcomes.iter().find(|o| o.rank == 0).unwrap().membership.clone();
        let epochs = m.epochs();
        assert_eq!(epochs.len(), 4, "{dtype}: {epochs:?}");
        let sets: Vec<&[u32]> = epochs.iter().map(|(_, s)| &s[..]).collect();
        assert_eq!(sets, [&[0, 1][..], &[0, 1, 2], &[0, 1], &[0, 1, 3]], "{dtype}");
        assert!(epochs[1].0 >= 4 && epochs[2].0 >= 9 && epochs[3].0 >= 12, "changes come after their requests: {epochs:?}");
        let want = reference(&text, &m);
        for o in &outcomes {
            match o.rank {
                2 => assert!(o.params.is_none(), "rank 2 left the job"),
                // A worker admitted at the last step or later trains nothing.
                3 if epochs[3].0 >= STEPS => assert!(o.params.is_none()),
                r => assert!(o.params.as_ref() == Some(&want), "{dtype}: worker {r} differs from the reference for {epochs:?}"),
            }
        }
        // A static run is a different training: the changes mattered.
        assert!(want != reference(&text, &Membership::new(vec![0, 1]).unwrap()));
    }
}

/// The only contributor vanishes before pushing while a joiner waits for the
/// version it starts from: the iterations nobody pushed are aggregated empty (the
/// parameters carry over) instead of stalling the job.
#[test]
fn iterations_whose_every_contributor_vanished_carry_the_parameters_over() {
    let text =
        common::spec_text(1, 2, 10, "f32", "adam", "bsp").replace("[job]", "[job]\nmax_workers = 2\nworker_lease_ms = 1000");
    let (spec, control) = start_control(&text);
    let progress = AtomicU64::new(0);
    let m = std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || run_server(control));
        }
        let first = s.spawn(|| {
            let mut w = Worker::join(&worker_config(control)).unwrap();
            let n = w.layout().total as usize;
            let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
            while w.iteration() < 4 {
                assert!(w.begin().unwrap());
                step(&mut w, &mut p, &mut g);
            }
            progress.store(4, Ordering::Release);
            // Vanish once a second worker is on its way, without pushing 4.
            wait_for(&progress, 5);
        });
        wait_for(&progress, 4);
        scale_workers(control, 2);
        let joiner = s.spawn(|| train(control, &|_, _| {}));
        progress.store(5, Ordering::Release);
        first.join().unwrap();
        let o = joiner.join().unwrap();
        assert_eq!(o.rank, 1);
        (o.membership, o.params.expect("the joiner trains to the end"))
    });
    let (m, got) = m;
    // Rank 0 pushed iterations 0..4 only.
    let sets = |t: u64| m.contributors(t).iter().copied().filter(|&r| r != 0 || t < 4).collect::<Vec<u32>>();
    assert!(sets(4).is_empty(), "{:?}", m.epochs());
    let want = common::reference_sets(&text, &sets, &mut |p, r, t, g| common::gradient(p, r, t, g));
    assert!(got == want, "differs from the reference with iteration 4 empty: {:?}", m.epochs());
}

#[test]
fn a_vanished_worker_is_removed_when_its_lease_expires() {
    let text = common::spec_text(3, 2, 12, "f32", "sgd", "bsp").replace("[job]", "[job]\nworker_lease_ms = 1000");
    let (spec, control) = start_control(&text);
    let started = Instant::now();
    let params: Vec<Option<Vec<u8>>> = std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || run_server(control));
        }
        let hs: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    let mut w = Worker::join(&worker_config(control)).unwrap();
                    let n = w.layout().total as usize;
                    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                    while w.iteration() < 12 {
                        // Rank 1 vanishes after iteration 4 without a word (as a
                        // killed process would): no push of 5, no more renewals.
                        if w.rank() == 1 && w.iteration() == 5 {
                            return None;
                        }
                        assert!(w.begin().unwrap());
                        step(&mut w, &mut p, &mut g);
                    }
                    let out = w.params_copy();
                    w.finish().unwrap();
                    Some(out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let took = started.elapsed();
    // Iterations 0..5 had three contributors; from 5 on, rank 1's push never came.
    let mut m = Membership::new(vec![0, 1, 2]).unwrap();
    m.schedule(5, 4, vec![0, 2]).unwrap();
    let want = reference(&text, &m);
    let finished: Vec<&Vec<u8>> = params.iter().flatten().collect();
    assert_eq!(finished.len(), 2);
    assert!(finished.iter().all(|p| **p == want), "survivors differ from the reference without rank 1 from iteration 5");
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

/// A worker that asks to leave (not the highest rank) trains until the vote
/// commits, then finishes; the others go on, equal to the reference with the
/// contributor sets the job used.
#[test]
fn a_worker_that_asks_to_leave_is_removed_at_a_boundary() {
    let text = common::spec_text(3, 2, 14, "f32", "adam", "bsp");
    let (spec, control) = start_control(&text);
    let outcomes: Vec<Outcome> = std::thread::scope(|s| {
        for _ in 0..spec.job.servers {
            s.spawn(move || run_server(control));
        }
        let hs: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(move || {
                    let mut w = Worker::join(&worker_config(control)).unwrap();
                    let n = w.layout().total as usize;
                    let (mut p, mut g) = (vec![0f32; n], vec![0f32; n]);
                    while w.iteration() < 14 {
                        if !w.begin().unwrap() {
                            let out = Outcome { rank: w.rank(), membership: w.membership().clone(), params: None };
                            w.finish().unwrap();
                            return out;
                        }
                        step(&mut w, &mut p, &mut g);
                        if w.rank() == 1 && w.iteration() == 4 {
                            // Retried while the job is busy (none here, but a vote may be).
                            let deadline = Instant::now() + Duration::from_secs(30);
                            while let Err(e) = w.leave() {
                                assert!(e.to_string().contains("in progress") && Instant::now() < deadline, "{e}");
                                std::thread::sleep(Duration::from_millis(5));
                            }
                        }
                    }
                    let out = Outcome { rank: w.rank(), membership: w.membership().clone(), params: Some(w.params_copy()) };
                    w.finish().unwrap();
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let m = outcomes.iter().find(|o| o.rank == 0).unwrap().membership.clone();
    let sets: Vec<&[u32]> = m.epochs().iter().map(|(_, s)| &s[..]).collect();
    assert_eq!(sets, [&[0, 1, 2][..], &[0, 2]], "{:?}", m.epochs());
    assert!(m.epochs()[1].0 >= 5, "the change comes after the request: {:?}", m.epochs());
    let want = reference(&text, &m);
    for o in &outcomes {
        match o.rank {
            1 => assert!(o.params.is_none(), "rank 1 left"),
            r => assert!(o.params.as_ref() == Some(&want), "worker {r} differs from the reference"),
        }
    }
}

/// A change asked for the moment the job can take it (as a scheduler that
/// shrinks a job it just started does) may be in the map a worker registers
/// with: every worker still votes on it, and the job goes on without the one
/// that leaves.
#[test]
fn a_change_asked_while_the_workers_register_is_voted_on_by_all() {
    let text = common::spec_text(2, 1, 6, "f32", "adam", "bsp");
    for round in 0..6 {
        let (_, control) = start_control(&text);
        // Outside the scope: a worker stuck on a vote fails the test (its wait
        // times out) instead of leaving it waiting for the server to end.
        let server = std::thread::spawn(move || run_server(control));
        let outcomes: Vec<Outcome> = std::thread::scope(|s| {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !status(control).contains("1 ready") {
                assert!(Instant::now() < deadline, "the server never became ready");
                std::thread::sleep(Duration::from_millis(2));
            }
            // Asked again and again until the second worker has registered.
            let asker = s.spawn(move || {
                let mut c = ControlClient::connect(control, &secret(), Duration::from_secs(10)).unwrap();
                loop {
                    match c.call(&ControlMsg::ScaleWorkers { workers: 1 }) {
                        Ok(_) => return,
                        Err(e) if e.is_temporary() && Instant::now() < deadline => std::thread::sleep(Duration::from_micros(200)),
                        Err(e) => panic!("round {round}: {e}"),
                    }
                }
            });
            let hs: Vec<_> = (0..2).map(|_| s.spawn(|| train(control, &|_, _| {}))).collect();
            asker.join().unwrap();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        server.join().unwrap();
        let o = outcomes.iter().find(|o| o.params.is_some()).expect("one worker trains to the end");
        let sets: Vec<&[u32]> = o.membership.epochs().iter().map(|(_, s)| &s[..]).collect();
        assert_eq!(sets.len(), 2, "round {round}: {:?}", o.membership.epochs());
        assert_eq!(outcomes.iter().filter(|o| o.params.is_none()).count(), 1, "round {round}: one worker left");
        assert!(o.params.as_ref() == Some(&reference(&text, &o.membership)), "round {round}: differs from the reference");
    }
}
