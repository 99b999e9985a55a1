//! The simulated network: a virtual clock and a seeded queue of deliveries.
//! Every channel between two nodes is FIFO (as a reliable connected queue pair
//! is); delays are random, so messages on different channels interleave in every
//! order the seed picks.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use eps_proto::control::{JobMap, Order};

/// A participant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Node {
    /// The control plane (its lease clock and the scale plan).
    Ctl,
    /// A server by rank.
    Server(u32),
    /// A worker by rank.
    Worker(u32),
}

/// What travels.
#[derive(Clone, Debug)]
pub enum Msg {
    /// Worker -> server: gradient of shard `shard` for iteration `t` (a digest per
    /// alignment unit of the shard).
    Push { w: u32, shard: u32, t: u64, token: Vec<u64> },
    /// Worker -> server: send shard `shard` at version >= `need`.
    PullReq { w: u32, shard: u32, need: u64 },
    /// Worker -> server: the worker's connection closed (sent last on its channel).
    ConnLost { w: u32 },
    /// Server -> worker: version `v` of `shard` is in the worker's buffer (a value
    /// per unit).
    PullDone { shard: u32, v: u64, value: Vec<u64> },
    /// Server -> worker: the push was routed with an old epoch.
    Moved { shard: u32, t: u64 },
    /// Server -> worker (SSP/ASP): the worker's contribution to `shard` was
    /// applied; its landing slot takes the next.
    Credit { shard: u32 },
    /// Worker -> server (ASP): an RDMA READ of the shard's published copy.
    Read { w: u32, shard: u32 },
    /// Server -> worker (ASP): what the READ found, version `v`.
    ReadDone { shard: u32, v: u64, value: Vec<u64> },
    /// Server -> worker: the pull request will not be served here.
    PullMoved { shard: u32 },
    /// Server -> itself: the WRITE of a pull completed.
    PullWritten { shard: u32, w: u32, v: u64 },
    /// Source -> target: the snapshot of `shard` at version `v` (SSP/ASP:
    /// with the contributions of each worker it holds).
    Snapshot { shard: u32, v: u64, value: Vec<u64>, clocks: Vec<u64> },
    /// SSP/ASP source -> target after the cutover: worker `w`'s contribution
    /// of iteration `t`, relayed (acknowledged with a `ForwardAck`).
    Relayed { shard: u32, w: u32, t: u64, digest: Vec<u64> },
    /// Source -> itself: the snapshot WRITE completed.
    SnapshotDone { shard: u32 },
    /// Source -> target: the update producing version `v` (its contributions'
    /// digest); an empty digest is the zero-length notice that the cutover is
    /// at the snapshot's version `v` and no forward follows.
    Forward { shard: u32, v: u64, digest: Vec<u64> },
    /// Target -> source.
    ForwardAck { shard: u32, v: u64 },
    /// Owner -> itself: the snapshot for a new backup is written.
    ReplicaSnapshotDone { shard: u32 },
    /// Worker -> server: its sparse push of iteration `t` (key and gradient
    /// digest per row).
    SparsePush { w: u32, t: u64, rows: Vec<(u64, u64)> },
    /// Worker -> server: the rows of `keys` at version `v`.
    SparsePull { w: u32, v: u64, keys: Vec<u64> },
    /// Server -> worker: version `v` of the rows asked (key and row digest).
    SparseRows { v: u64, rows: Vec<(u64, u64)> },
    /// Server -> worker: its last sparse push was applied.
    SparseCredit,
    /// Source -> target: the target's READ of the rows the source took out
    /// for it completed.
    RowsRead { from: u32 },
    /// Server `s` crashed: its connections failed (the last thing heard from it
    /// on each channel).
    ServerGone { s: u32 },
    /// The control plane's view: server `s` stopped renewing and is declared lost.
    Lost { s: u32 },
    /// Control -> server: new orders.
    Orders(Vec<Order>),
    /// Control -> worker: a newer map (the worker's long poll).
    Map(Box<JobMap>),
    /// A timer: a worker's computation ended; the control plane's lease clock.
    Tick,
    /// The scale plan's next event.
    Plan,
}

/// Seeded splitmix64.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// From a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x0005_EED0_FE95)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// A 64-bit finalizer (splitmix64's).
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of two values (order matters).
pub fn h2(a: u64, b: u64) -> u64 {
    mix(a ^ mix(b).rotate_left(17))
}

/// The queue of deliveries.
#[derive(Debug)]
pub struct Net {
    /// Virtual time.
    pub now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    pending: BTreeMap<u64, (Node, Node, Msg)>,
    /// Latest delivery time per channel (FIFO).
    last: BTreeMap<(Node, Node), u64>,
    /// Largest random delay.
    pub max_delay: u64,
}

impl Net {
    /// An empty network.
    pub fn new(max_delay: u64) -> Self {
        Self { now: 0, seq: 0, queue: BinaryHeap::new(), pending: BTreeMap::new(), last: BTreeMap::new(), max_delay }
    }

    /// Sends `msg` from `from` to `to` with a random delay, after everything sent
    /// earlier on the same channel.
    pub fn send(&mut self, rng: &mut Rng, from: Node, to: Node, msg: Msg) {
        let d = rng.range(1, self.max_delay);
        self.send_after(from, to, msg, d);
    }

    /// Sends with a given delay (still FIFO per channel).
    pub fn send_after(&mut self, from: Node, to: Node, msg: Msg, delay: u64) {
        let last = self.last.entry((from, to)).or_insert(0);
        let at = (self.now + delay).max(*last);
        *last = at;
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq)));
        self.pending.insert(self.seq, (from, to, msg));
    }

    /// The next delivery, advancing the clock to it.
    pub fn pop(&mut self) -> Option<(Node, Node, Msg)> {
        loop {
            let Reverse((at, seq)) = self.queue.pop()?;
            if let Some(d) = self.pending.remove(&seq) {
                self.now = at;
                return Some(d);
            }
        }
    }

    /// Messages from a worker to `to` still in flight (other than its connection
    /// closing).
    pub fn from_workers_to(&self, to: Node) -> usize {
        self.pending
            .values()
            .filter(|(f, t, m)| *t == to && matches!(f, Node::Worker(_)) && !matches!(m, Msg::ConnLost { .. }))
            .count()
    }

    /// Pushes of `shard` to server `rank` in flight.
    pub fn pushes_to(&self, rank: u32, shard: u32) -> usize {
        self.pending
            .values()
            .filter(|(_, t, m)| *t == Node::Server(rank) && matches!(m, Msg::Push { shard: s, .. } if *s == shard))
            .count()
    }

    /// Drops queued deliveries that match `f` (work requests a torn-down
    /// connection never completes).
    pub fn discard(&mut self, f: impl Fn(&Node, &Node, &Msg) -> bool) {
        self.pending.retain(|_, (from, to, m)| !f(from, to, m));
    }

    /// A crash of `node`: what it sent is cut at a random point per channel (a
    /// prefix of each channel still lands, as the connection breaks at some
    /// point of its stream), and its own timers and completions go. Returns
    /// the messages cut, in the order they were sent.
    pub fn cut(&mut self, node: Node, rng: &mut Rng) -> Vec<(Node, Node, Msg)> {
        let mut broken: BTreeMap<Node, bool> = BTreeMap::new();
        let mut gone = Vec::new();
        let seqs: Vec<u64> = self.pending.iter().filter(|(_, (f, _, _))| *f == node).map(|(&s, _)| s).collect();
        for seq in seqs {
            let to = self.pending[&seq].1;
            let cut = to == node || *broken.entry(to).or_insert(false) || rng.range(0, 2) == 0;
            broken.insert(to, cut);
            if cut && let Some(m) = self.pending.remove(&seq) {
                gone.push(m);
            }
        }
        gone
    }

    /// Deliveries still queued.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}
