//! Nodes with capacities, and where each job's processes run on them. A
//! policy decides how many workers and servers a job has; the placement puts
//! each process on a node with a free slot: a growing job first on the nodes
//! it runs on already (fewer nodes, less traffic between them), then on the
//! node with the most free slots; a shrinking job leaves the node where it has
//! the fewest processes first. Shrinks of a decision are applied before its
//! growths, so the slots they free are there for the others.

use crate::model::Alloc;

/// A machine of the cluster: its name and its slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Its name (a host name, a Slurm node).
    pub name: String,
    /// Processes it runs at most.
    pub slots: u32,
}

/// Parses `NAME:SLOTS,NAME:SLOTS,...`.
pub fn parse_nodes(text: &str) -> Result<Vec<Node>, String> {
    let mut out: Vec<Node> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = |why: &str| format!("node {item:?}: {why} (expected NAME:SLOTS, e.g. node1:8)");
        let (name, slots) = item.rsplit_once(':').ok_or_else(|| bad("no ':'"))?;
        let slots: u32 = slots.trim().parse().map_err(|_| bad("the slots are not a whole number"))?;
        if slots == 0 {
            return Err(bad("a node needs at least one slot"));
        }
        let name = name.trim().to_string();
        if name.is_empty() || out.iter().any(|n| n.name == name) {
            return Err(bad("empty, or a name already used"));
        }
        out.push(Node { name, slots });
    }
    if out.is_empty() {
        return Err("no node given".into());
    }
    Ok(out)
}

/// One node of `slots` slots named `local` (a cluster given by its size).
pub fn one_node(slots: u32) -> Vec<Node> {
    vec![Node { name: "local".into(), slots }]
}

/// Where every job's processes run.
#[derive(Clone, Debug)]
pub struct Placement {
    nodes: Vec<Node>,
    /// Slots used per node.
    used: Vec<u32>,
    /// Per job (by the caller's index): its workers and servers per node.
    jobs: Vec<Vec<Alloc>>,
}

impl Placement {
    /// An empty cluster of `nodes`.
    pub fn new(nodes: Vec<Node>) -> Self {
        let used = vec![0; nodes.len()];
        Self { nodes, used, jobs: Vec::new() }
    }

    /// Slots of all nodes.
    pub fn slots(&self) -> u32 {
        self.nodes.iter().map(|n| n.slots).sum()
    }

    /// The nodes.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Slots used per node.
    pub fn used(&self) -> &[u32] {
        &self.used
    }

    /// Job `job`'s workers and servers per node (empty if it has none).
    pub fn of(&self, job: usize) -> &[Alloc] {
        self.jobs.get(job).map_or(&[], Vec::as_slice)
    }

    /// Nodes job `job` runs on.
    pub fn span(&self, job: usize) -> usize {
        self.of(job).iter().filter(|a| a.slots() > 0).count()
    }

    /// `job`'s processes per node as `name:Nw+Ms,...`.
    pub fn describe(&self, job: usize) -> String {
        let parts: Vec<String> = self
            .of(job)
            .iter()
            .zip(&self.nodes)
            .filter(|(a, _)| a.slots() > 0)
            .map(|(a, n)| format!("{}:{}w+{}s", n.name, a.workers, a.servers))
            .collect();
        parts.join(",")
    }

    fn total(&self, job: usize) -> Alloc {
        self.of(job)
            .iter()
            .fold(Alloc::default(), |t, a| Alloc { workers: t.workers + a.workers, servers: t.servers + a.servers })
    }

    /// Shrinks `job` to at most `to` (each resource separately): processes
    /// leave the nodes where the job has the fewest first.
    pub fn shrink(&mut self, job: usize, to: Alloc) {
        if self.jobs.len() <= job {
            return;
        }
        let mut have = self.total(job);
        while have.workers > to.workers || have.servers > to.servers {
            let worker = have.workers > to.workers;
            let per = &self.jobs[job];
            let Some(k) = (0..per.len())
                .filter(|&k| if worker { per[k].workers > 0 } else { per[k].servers > 0 })
                .min_by_key(|&k| (per[k].slots(), std::cmp::Reverse(k)))
            else {
                break;
            };
            let a = &mut self.jobs[job][k];
            if worker {
                a.workers -= 1;
                have.workers -= 1;
            } else {
                a.servers -= 1;
                have.servers -= 1;
            }
            self.used[k] -= 1;
        }
    }

    /// Grows `job` to `to` (each resource separately): new processes go to a
    /// node the job runs on with a free slot (the one where it has the most),
    /// else to the node with the most free slots. Fails when no node has a
    /// free slot (shrink the others first).
    pub fn grow(&mut self, job: usize, to: Alloc) -> Result<(), String> {
        if self.jobs.len() <= job {
            self.jobs.resize(job + 1, Vec::new());
        }
        if self.jobs[job].is_empty() {
            self.jobs[job] = vec![Alloc::default(); self.nodes.len()];
        }
        let mut have = self.total(job);
        while have.workers < to.workers || have.servers < to.servers {
            let free = |k: usize| self.nodes[k].slots - self.used[k];
            let per = &self.jobs[job];
            let k = (0..self.nodes.len())
                .filter(|&k| free(k) > 0)
                .max_by_key(|&k| {
                    (per[k].slots() > 0, if per[k].slots() > 0 { per[k].slots() } else { free(k) }, std::cmp::Reverse(k))
                })
                .ok_or_else(|| {
                    format!(
                        "no node has a free slot for job {job} ({} of {} slots used)",
                        self.used.iter().sum::<u32>(),
                        self.slots()
                    )
                })?;
            let a = &mut self.jobs[job][k];
            if have.workers < to.workers {
                a.workers += 1;
                have.workers += 1;
            } else {
                a.servers += 1;
                have.servers += 1;
            }
            self.used[k] += 1;
        }
        Ok(())
    }

    /// Applies a decision: every job's new allocation, shrinks before growths.
    pub fn apply(&mut self, allocs: &[(usize, Alloc)]) -> Result<(), String> {
        for &(job, a) in allocs {
            self.shrink(job, a);
        }
        for &(job, a) in allocs {
            self.grow(job, a)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(workers: u32, servers: u32) -> Alloc {
        Alloc { workers, servers }
    }

    #[test]
    fn nodes_parse_and_bad_ones_say_why() {
        let n = parse_nodes("a:4, b:8").unwrap();
        assert_eq!((n[1].name.as_str(), n[1].slots), ("b", 8));
        for (bad, why) in
            [("a", "no ':'"), ("a:x", "whole number"), ("a:0", "at least one"), ("a:1,a:2", "already"), ("", "no node")]
        {
            assert!(parse_nodes(bad).unwrap_err().contains(why), "{bad}");
        }
    }

    #[test]
    fn jobs_pack_onto_their_nodes_and_capacity_holds_through_random_decisions() {
        let mut p = Placement::new(parse_nodes("a:4,b:4,c:2").unwrap());
        p.apply(&[(0, a(2, 1))]).unwrap();
        assert_eq!(p.span(0), 1, "a small job fits one node: {}", p.describe(0));
        p.apply(&[(1, a(3, 1))]).unwrap();
        assert_eq!(p.span(1), 1, "{}", p.describe(1));
        // Job 0 grows past its node: it keeps its node and spills over.
        p.apply(&[(0, a(3, 2))]).unwrap();
        assert_eq!(p.span(0), 2, "{}", p.describe(0));
        assert!(p.grow(2, a(2, 1)).is_err(), "the cluster is full");
        // A decision that shrinks one job and grows another fits.
        p.apply(&[(0, a(1, 1)), (2, a(2, 1))]).unwrap();
        assert!(p.used().iter().zip(p.nodes()).all(|(u, n)| *u <= n.slots));
        // Random decisions within the slots never overfill a node.
        let mut x = 7u64;
        let mut rnd = |m: u32| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % u64::from(m)) as u32
        };
        for _ in 0..2000 {
            let mut left = p.slots();
            let mut d = Vec::new();
            for j in 0..4 {
                let w = rnd(left.min(4) + 1);
                let s = rnd((left - w).min(2) + 1);
                left -= w + s;
                d.push((j, a(w, s)));
            }
            p.apply(&d).unwrap();
            for &(j, want) in &d {
                assert_eq!(p.of(j).iter().map(|a| a.slots()).sum::<u32>(), want.slots());
            }
            assert!(p.used().iter().zip(p.nodes()).all(|(u, n)| *u <= n.slots), "{:?}", p.used());
        }
    }
}
