//! The simulation's invariants, checked as it runs and at its end: a
//! retired server holds nothing, every version some worker may need is
//! servable by someone, and the final parameters equal the reference.

use super::*;

impl World {
    /// Server `rank` retired (it exits): no live worker may still route to it or
    /// have a request to it in flight.
    pub(crate) fn check_retired(&mut self, rank: u32) {
        let in_flight = self.net.from_workers_to(Node::Server(rank));
        let routing: Vec<u32> = self
            .workers
            .values()
            .flatten()
            .filter(|w| w.live() && w.state != WState::AwaitAdmit && w.routes_to(rank))
            .map(|w| w.rank)
            .collect();
        if in_flight > 0 || !routing.is_empty() {
            self.fail(format!(
                "server {rank} retired with {in_flight} worker requests in flight; workers {routing:?} still route to it"
            ));
        }
    }

    /// Every version a live worker needs next is servable by some server (unless
    /// the worker does not contribute to that iteration: it leaves there and does
    /// not use the version).
    pub(crate) fn check_servable(&mut self) {
        let mut bad = None;
        let members = Membership::from_epochs(self.job.job_map().membership);
        for w in self.workers.values().flatten() {
            if !w.live() || w.state == WState::AwaitAdmit {
                continue;
            }
            for u in 0..self.units {
                let need = w.need(u);
                if members.as_ref().is_some_and(|m| !m.contributors(need).contains(&w.rank)) {
                    continue;
                }
                let ok = self.servers.iter().flatten().any(|sv| !sv.retired && sv.serves_unit(u, need));
                if !ok {
                    bad = Some(format!(
                        "worker {} ({:?}, iteration {}) needs version {need} of unit {u}, which no server serves",
                        w.rank, w.state, w.t
                    ));
                }
            }
        }
        if let Some(b) = bad {
            self.fail(b);
        }
    }

    /// Who is where, for a stall report.
    pub(crate) fn dump(&self) -> String {
        let mut t = String::new();
        for w in self.workers.values().flatten() {
            t += &format!(
                "worker {}: {:?} at iteration {}, holds {:?}, {}\n",
                w.rank,
                w.state,
                w.t,
                w.have.iter().map(|h| h.0).collect::<Vec<_>>(),
                w.describe()
            );
        }
        for s in self.servers.iter().flatten() {
            t += &format!("server {}: {}\n", s.rank, s.describe());
        }
        t + &self.job.status()
    }

    /// The end: progress, and the parameters equal the reference.
    pub(crate) fn check_end(&mut self) {
        let mut done = 0;
        let stuck = self.workers.values().flatten().any(|w| !matches!(w.state, WState::Done | WState::Left | WState::Crashed));
        if stuck {
            let what = format!("no progress: the network fell silent\n{}", self.dump());
            return self.fail(what);
        }
        for w in self.workers.values().flatten() {
            done += u32::from(w.state == WState::Done);
        }
        if done == 0 {
            return self.fail("no worker trained to the last step".into());
        }
        let Some(m) = Membership::from_epochs(self.job.job_map().membership) else {
            return self.fail("invalid final membership".into());
        };
        for s in 0..self.units {
            let mut value = init_value(s);
            for t in 0..self.steps {
                let mut d = 0u64;
                for &r in m.contributors(t) {
                    let gone = self.lost.iter().any(|&(x, at)| x == r && t < at);
                    if gone && !self.accepted.contains(&(r, s, t)) {
                        continue;
                    }
                    d = h2(d, h2(u64::from(r), token(r, t, s, value)));
                }
                value = h2(h2(value, t), d);
                match self.published.get(&(s, t + 1)) {
                    Some(&got) if got == value => {}
                    got => {
                        return self.fail(format!(
                            "unit {s} version {} is {got:x?}, the reference for the contributor sets {:?} (lost {:?}) is {value:x}",
                            t + 1,
                            m.epochs(),
                            self.lost
                        ));
                    }
                }
            }
        }
        self.check_sparse_end(&m);
        self.report.membership_changes = self.job.membership_changes();
    }
}
