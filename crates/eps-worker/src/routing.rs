//! Where a worker sends each shard: the servers it connects to and says
//! hello to, the shard map it adopts (newest epoch first), and the route of a
//! shard for an iteration.

use eps_core::route;

use super::*;

impl<P: Fabric> Worker<P> {
    /// Connects to server `rank` if not yet connected, and says hello.
    pub(crate) fn connect(&mut self, rank: u32) -> Result<(), WorkerError> {
        if self.qps.get(rank as usize).is_some_and(Option::is_some) {
            return Ok(());
        }
        let addr = self.map.server_addr(rank).ok_or(WorkerError::NoAddress(rank))?;
        let addr: SocketAddr = addr.parse().map_err(|_| WorkerError::NoAddress(rank))?;
        let qp = self.pd.connect(addr, &self.cq, &self.cq, &self.opts)?;
        for _ in 0..self.opts.max_recv_wr {
            qp.post_recv(&RecvWr { wr_id: 0, sg: &[] })?;
        }
        qp.post_send(&SendWr { wr_id: WR_HELLO, op: SendOp::Send, sg: &[Sge::whole(&self.hello)], signaled: true })?;
        self.hellos_sent += 1;
        self.qp_rank.insert(qp.qp_num(), rank);
        if self.qps.len() <= rank as usize {
            self.qps.resize_with(rank as usize + 1, || None);
        }
        self.qps[rank as usize] = Some(qp);
        let n = self.hellos_sent;
        self.wait_until(|w| w.hellos_acked >= n, "hello acknowledgements")
    }

    /// Takes the newest map the watcher fetched, if it is newer than ours.
    pub(crate) fn adopt_newest(&mut self) -> Result<(), WorkerError> {
        if self.watch.newest.load(Ordering::Acquire) <= self.map.epoch {
            return Ok(());
        }
        let m = self.watch.latest.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(m) = m.filter(|m| m.epoch > self.map.epoch) {
            self.adopt(m)?;
        }
        Ok(())
    }

    pub(crate) fn adopt(&mut self, m: JobMap) -> Result<(), WorkerError> {
        if m.routes.len() < self.map.routes.len() || m.routes.len() > eps_proto::layout::MAX_SHARDS as usize {
            return Err(WorkerError::Unexpected);
        }
        // With replicas, a server the new map leaves out was declared lost.
        // If this round still waits on it, its requests go to the shards'
        // backups now, as when its connection fails: that connection need
        // not fail first (a stopped server's does not, nor does one with
        // nothing of ours in flight when it died), and once the new map is
        // ours, `notice_lost_servers` has nothing newer to compare with.
        if self.spec.job.replicas > 1 {
            for s in route::left_out(&self.map, &m) {
                let waits_on = self.round.iter().any(|&sid| self.pushed_to[sid] == s && self.outstanding[sid] > 0);
                if !self.lost.contains(&s) && (self.routes_to(s) || waits_on || self.sparse.holds(s)) {
                    self.lose_server(s);
                }
            }
        }
        self.map = m;
        // Shards made by splits since.
        let ids = self.map.routes.len();
        self.credit.resize(ids, true);
        self.round_pulled.resize(ids, false);
        self.outstanding.resize(ids, 0);
        self.sending.resize(ids, 0);
        self.pushed_to.resize(ids, u32::MAX);
        for o in self.needed_owners() {
            if self.lost.contains(&o) {
                continue;
            }
            match self.connect(o) {
                // With replicas, a server that cannot be reached is treated as
                // lost: a map that routes its shards to their backups comes.
                Err(e) if self.spec.job.replicas > 1 && !matches!(e, WorkerError::Removed { .. }) => {
                    eps_proto::say!("eps worker {}: cannot reach server {o} ({e})", self.rank);
                    self.lose_server(o);
                    self.report_unreachable(o);
                }
                r => r?,
            }
        }
        Ok(())
    }

    /// Servers this worker may still talk to: holders of sparse tables, owners of shards not split before
    /// its iteration, and previous owners until their cutover.
    pub(crate) fn needed_owners(&self) -> Vec<u32> {
        let t = self.iteration;
        let mut v: Vec<u32> = Vec::new();
        for r in self.map.routes.iter().filter(|r| r.until > t) {
            v.push(r.owner.owner);
            if let Some((p, at)) = &r.previous
                && t < *at
            {
                v.push(p.owner);
            }
        }
        // And every server holding a part of a sparse table.
        v.extend(self.map.tables.iter().map(|e| e.owner));
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Reports (through the watcher's next poll) that this worker routes with its
    /// map's epoch and needs no server that epoch drained: called when a round
    /// begins (the previous round's answers all came), and only once no shard's
    /// route for this iteration is its previous owner. A server scaled away
    /// retires only once every worker reported its draining epoch, so it never
    /// leaves while a worker still talks to it.
    ///
    /// In SSP/ASP a pushed contribution may still be on its way when a round
    /// begins; a new epoch is reported only once every push was credited, so a
    /// migration source relaying for this worker knows none will come.
    pub(crate) fn report_routing(&mut self) -> Result<(), WorkerError> {
        let t = self.iteration;
        // (A bucket map's cutover counts as a route's: until it, the servers
        // giving buckets away are still needed.)
        if route::settled(&self.map, t) {
            if self.watch.adopted.load(Ordering::Acquire) >= self.map.epoch {
                return Ok(());
            }
            if self.mode != Consistency::Bsp {
                self.wait_until(|w| w.credit.iter().all(|&c| c), "credits before routing with a new shard map")?;
            }
            self.watch.adopted.store(self.map.epoch, Ordering::Release);
            // Say so now rather than with the watcher's next long poll: a server
            // waits for it to retire or to end a redirect window.
            let (worker, adopted, iteration) = (self.rank, self.map.epoch, self.iteration);
            self.ctl.call(&ControlMsg::GetMap { worker, adopted, min_epoch: 0, iteration })?;
        }
        Ok(())
    }

    /// Blocks until a map newer than ours is known (after a "moved" answer).
    pub(crate) fn refresh_map(&mut self) -> Result<(), WorkerError> {
        let deadline = Instant::now() + self.timeout;
        let have = self.map.epoch;
        // Report only the epoch `report_routing` decided: the map held may still
        // route to a previous owner this worker has not passed the cutover of,
        // and reporting it would let that owner retire while still needed.
        let adopted = self.watch.adopted.load(Ordering::Acquire);
        while Instant::now() < deadline {
            let req = ControlMsg::GetMap { worker: self.rank, adopted, min_epoch: have + 1, iteration: self.iteration };
            if let ControlMsg::Map(m) = self.ctl.call(&req)?
                && m.epoch > have
            {
                return self.adopt(m);
            }
        }
        Err(WorkerError::Timeout("a newer shard map after a \"moved\" answer"))
    }

    /// Whether this worker still needs server `rank`: it owns a shard, or owned one
    /// whose cutover this worker has not reached yet.
    pub(crate) fn routes_to(&self, rank: u32) -> bool {
        route::routes_to(&self.map, self.iteration, rank)
    }

    /// Where the push of `iteration` for shard `sid` (and the pull after it) goes.
    pub(crate) fn route(&self, sid: usize, iteration: u64) -> &ShardEndpoint {
        self.map.routes[sid].for_iteration(iteration)
    }
}
