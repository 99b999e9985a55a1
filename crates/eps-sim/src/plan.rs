//! The run's events beside the job's own traffic: the control plane's lease
//! clock, and the scale plan drawn from the seed (server and worker scale
//! events, crashes of workers and servers, control-plane failovers).

use super::*;

impl World {
    pub(crate) fn live_workers(&self) -> Vec<u32> {
        self.workers.iter().filter(|(_, w)| w.as_ref().is_some_and(SimWorker::live)).map(|(&r, _)| r).collect()
    }

    /// The control plane's lease clock: watchers renew; silent workers expire.
    pub(crate) fn lease_tick(&mut self) {
        let now = self.net.now;
        for &r in &self.watching {
            self.seen.insert(r, now);
        }
        // (A rank a scale admitted has the join deadline to register; the
        // simulated one is the lease's. A registering worker sets its `seen`.)
        let mut due = self.job.awaited_workers();
        due.extend(self.job.leased_workers());
        for r in due {
            let seen = *self.seen.entry(r).or_insert(now);
            if now - seen > LEASE {
                self.note(format!("worker {r}'s lease expired"));
                self.report.lease_expiries += 1;
                if let Err(e) = self.ctl(&ControlMsg::Expire { rank: r }) {
                    self.fail(format!("expiring worker {r}: {e}"));
                }
            }
        }
        // (The clock runs while a worker holds a lease: one that crashed
        // after the others finished still expires, and the job ends.)
        if !self.live_workers().is_empty() || !self.job.leased_workers().is_empty() || !self.job.awaited_workers().is_empty() {
            self.net.send_after(Node::Ctl, Node::Ctl, Msg::Tick, TICK);
        }
    }

    /// One event of the scale plan drawn from the seed.
    pub(crate) fn plan_step(&mut self) {
        if self.plan_left == 0 || self.live_workers().is_empty() {
            return;
        }
        self.plan_left -= 1;
        let roll = self.rng.range(0, 99);
        if roll < 40 && self.replicas > 1 {
            // (Jobs with replicas do not scale their servers here: crashes.)
            self.try_crash_server();
        } else if roll < 40 {
            let n = self.rng.range(1, 4) as u32;
            if self.ctl(&ControlMsg::Scale { servers: n }).is_ok() {
                self.report.scales.0 += 1;
                self.note(format!("plan: servers -> {n}"));
                // Start the servers the control plane made room for.
                loop {
                    let before = self.servers.len();
                    self.start_server(&[], &[]);
                    if self.servers.len() == before || self.failure.is_some() {
                        break;
                    }
                }
            }
        } else if self.mode != Consistency::Bsp {
            // SSP/ASP jobs keep their workers (the control plane refuses
            // changes) and have no checkpoints to roll back to here.
        } else if roll < 75 {
            let n = self.rng.range(1, 4) as u32;
            let now = self.job.job_map().membership.last().map_or(0, |(_, s)| s.len() as u32);
            if self.ctl(&ControlMsg::ScaleWorkers { workers: n }).is_ok() {
                self.report.scales.1 += 1;
                self.note(format!("plan: workers {now} -> {n}"));
                self.report.worker_leaves += u64::from(now.saturating_sub(n));
                for _ in now..n {
                    self.start_worker();
                }
            }
        } else if roll >= 90 && self.replicas == 1 && self.sparse.is_none() {
            // (Tables have no checkpoints yet.)
            self.try_crash_and_roll_back();
        } else if roll < 90 {
            // Crash a contributor while another one stays (a job whose every
            // worker is gone cannot go on, and that is not what is checked here).
            let map = self.job.job_map();
            let latest = map.membership.last().map(|(_, s)| s.clone()).unwrap_or_default();
            let live: Vec<u32> = self.live_workers().into_iter().filter(|r| latest.contains(r)).collect();
            if live.len() >= 2 && map.proposal == 0 && self.report.crashes < 2 {
                let r = live[self.rng.range(0, live.len() as u64 - 1) as usize];
                self.crash(r);
            }
        }
        // A third of the plan's events also crash the control plane.
        if self.failure.is_none() && self.rng.range(0, 2) == 0 {
            self.fail_over();
        }
        let d = self.rng.range(20, 150);
        self.net.send_after(Node::Ctl, Node::Ctl, Msg::Plan, d);
    }

    pub(crate) fn crash(&mut self, r: u32) {
        let Some(Some(w)) = self.workers.get_mut(&r) else { return };
        w.state = WState::Crashed;
        let t = w.t;
        self.watching.remove(&r);
        self.report.crashes += 1;
        self.report.worker_leaves += 1;
        self.note(format!("worker {r} crashed at iteration {t}"));
        // Its connections close: pull WRITEs to it may never complete, and the
        // close is the last thing each server hears from it.
        self.net.discard(|_, _, m| matches!(m, Msg::PullWritten { w, .. } if *w == r));
        for s in 0..self.servers.len() as u32 {
            self.send(Node::Worker(r), Node::Server(s), Msg::ConnLost { w: r });
        }
    }

    /// Crashes a server whose every shard has a backup that can be promoted,
    /// while another server stays and no earlier crash is still undeclared.
    pub(crate) fn try_crash_server(&mut self) {
        let live: Vec<u32> = self.job.job_map().servers.iter().map(|(r, _)| *r).filter(|r| !self.down.contains(r)).collect();
        if live.len() < 2 || self.down.len() > self.job.lost_servers().len() || self.report.server_crashes >= 2 {
            return;
        }
        let safe: Vec<u32> = live.into_iter().filter(|&r| self.job.unprotected_on(r).is_empty()).collect();
        if safe.is_empty() {
            return;
        }
        let r = safe[self.rng.range(0, safe.len() as u64 - 1) as usize];
        let Some(s) = self.servers.get_mut(r as usize).and_then(Option::take) else { return };
        self.down.insert(r);
        self.report.server_crashes += 1;
        // Each connection breaks at some point of its stream; what it kept
        // from landing is lost, and so are the pushes the server held.
        let cut = self.net.cut(Node::Server(r), &mut self.rng);
        for (worker, us, t) in s.crash_losses(&cut) {
            self.unaccept(worker, us, t);
        }
        self.note(format!("server {r} crashed ({} messages cut): {}", cut.len(), s.describe()));
        // A worker sees the connection fail only if it had something on it
        // then (or sends something later): half of them here; the others
        // learn it from the map that leaves the server out.
        let watching: Vec<u32> = self.watching.iter().copied().collect();
        let told: Vec<u32> = watching.into_iter().filter(|_| self.rng.range(0, 1) == 0).collect();
        let peers: Vec<Node> = (0..self.servers.len() as u32)
            .filter(|&x| self.servers[x as usize].is_some())
            .map(Node::Server)
            .chain(told.into_iter().map(Node::Worker))
            .collect();
        for p in peers {
            self.send(Node::Server(r), p, Msg::ServerGone { s: r });
        }
        // The control plane declares it lost at once (two peers reported it)
        // or once its lease lapses: what it sent may still be landing then.
        let d = if self.rng.range(0, 1) == 0 { self.rng.range(1, self.net.max_delay) } else { self.rng.range(1, LEASE) };
        self.net.send_after(Node::Ctl, Node::Ctl, Msg::Lost { s: r }, d);
    }

    /// A worker finished: if it was the last, the job is over, and in a third
    /// of the jobs with replicas a server crashes as the job ends (the
    /// control plane has told it to retire; it never says it finished).
    pub(crate) fn worker_finished(&mut self) {
        if self.replicas > 1 && self.job.leased_workers().is_empty() && self.rng.range(0, 2) == 0 {
            self.note("a server crashes as the job ends".into());
            self.try_crash_server();
        }
    }
}
