//! Running EPS through Slurm: the allocation a job runs in (its nodes with
//! their CPUs and GPUs, read from Slurm), each role started as a job step
//! (`steps.rs`), and what a role logs of the step it runs in. `eps slurm
//! script` is in `train/sbatch.rs`.

pub mod steps;

use std::process::Command;

pub use steps::Steps;

/// The node this process runs on: Slurm's name for it in a job step, else
/// the host name.
pub fn node_name() -> Option<String> {
    std::env::var("SLURMD_NODENAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()))
}

/// In a Slurm job step: one line saying which (job, step, node) and what
/// Slurm bound it to (CPUs, GPUs), so a role's log says where it ran.
pub fn log_step(role: &str) {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let (Some(job), Some(step)) = (var("SLURM_JOB_ID"), var("SLURM_STEP_ID")) else { return };
    let node = var("SLURMD_NODENAME").unwrap_or_else(|| "?".into());
    let mut bound = Vec::new();
    for k in ["SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE", "SLURM_CPU_BIND_LIST", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"] {
        if let Some(v) = var(k) {
            bound.push(format!("{k}={v}"));
        }
    }
    if let Some(d) = var("EPS_RDMA_DEVICE") {
        bound.push(format!("EPS_RDMA_DEVICE={d}"));
    }
    eps_proto::say!(
        "eps {role}: Slurm job {job} step {step} on node {node}{}{}",
        if bound.is_empty() { "" } else { ": " },
        bound.join(" ")
    );
}

/// A node of an allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Slurm's name for it.
    pub name: String,
    /// CPUs of the allocation on it.
    pub cpus: u32,
    /// GPUs of the allocation on it.
    pub gpus: u32,
}

/// The Slurm allocation this process runs in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// `SLURM_JOB_ID`.
    pub job: String,
    /// Its nodes.
    pub nodes: Vec<Node>,
}

/// What to do when there is no allocation.
const OUTSIDE: &str = "--launcher slurm runs inside a Slurm allocation: start it under `salloc` or from an sbatch \
     script (`eps slurm script` writes one); SLURM_JOB_ID is not set";

/// The job id of the allocation this process runs in.
pub fn job_id() -> Result<String, String> {
    let id = std::env::var("SLURM_JOB_ID").ok().filter(|v| !v.is_empty()).ok_or(OUTSIDE)?;
    if !id.chars().all(|c| c.is_ascii_digit() || c == '_') {
        return Err(format!("SLURM_JOB_ID={id:?} is not a Slurm job id"));
    }
    Ok(id)
}

/// Runs a Slurm command, its stdout as text; an error says what failed.
fn slurm_cmd(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program} ({e}): Slurm's client commands must be on PATH for --launcher slurm"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{program} {} failed ({}): {}", args.join(" "), out.status, err.trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Allocation {
    /// The allocation this process runs in, asked of Slurm (`scontrol show
    /// job -d`); GPUs are those of the GRES named `gres`.
    pub fn current(gres: &str) -> Result<Self, String> {
        let job = job_id()?;
        let text = slurm_cmd("scontrol", &["show", "job", "-d", "-o", &job])?;
        let mut nodes = Vec::new();
        for (list, cpus, gpus) in parse_job_nodes(&text, gres)? {
            for name in slurm_cmd("scontrol", &["show", "hostnames", &list])?.split_whitespace() {
                nodes.push(Node { name: name.to_string(), cpus, gpus });
            }
        }
        if nodes.is_empty() {
            return Err(format!("Slurm job {job} has no nodes (is it running?)"));
        }
        Ok(Self { job, nodes })
    }
}

/// The per-node lines of `scontrol show job -d -o`: (node list, CPUs on
/// each of its nodes, GPUs of `gres` on each).
pub fn parse_job_nodes(text: &str, gres: &str) -> Result<Vec<(String, u32, u32)>, String> {
    let toks: Vec<&str> = text.split_whitespace().collect();
    let mut out = Vec::new();
    for (i, t) in toks.iter().enumerate() {
        let Some(list) = t.strip_prefix("Nodes=") else { continue };
        let Some(ids) = toks.get(i + 1).and_then(|t| t.strip_prefix("CPU_IDs=")) else { continue };
        let cpus = count_ids(ids).ok_or_else(|| format!("scontrol: cannot read CPU_IDs={ids}"))?;
        let gpus = toks[i + 1..]
            .iter()
            .take_while(|t| !t.starts_with("Nodes="))
            .find_map(|t| t.strip_prefix("GRES="))
            .map_or(0, |g| gpus_in(g, gres));
        out.push((list.to_string(), cpus, gpus));
    }
    if out.is_empty() {
        return Err("scontrol show job -d printed no `Nodes= CPU_IDs=` entries".into());
    }
    Ok(out)
}

/// The CPUs of a list such as `0-3,8,10-11`.
fn count_ids(ids: &str) -> Option<u32> {
    ids.split(',').try_fold(0u32, |n, r| {
        let (a, b) = r.split_once('-').unwrap_or((r, r));
        let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
        (b >= a).then(|| n + b - a + 1)
    })
}

/// The count of `gres` in a GRES field such as `gpu:a100:2(IDX:0-1),nic:1`.
fn gpus_in(field: &str, gres: &str) -> u32 {
    let mut n = 0;
    let mut depth = 0;
    let mut item = String::new();
    // Split on commas outside parentheses.
    for c in field.chars().chain([',']) {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                let name = item.split(':').next().unwrap_or("");
                if name == gres {
                    n += item.rsplit(':').next().and_then(|v| v.parse::<u32>().ok()).unwrap_or(0);
                }
                item.clear();
                continue;
            }
            _ if depth == 0 => item.push(c),
            _ => {}
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scontrol_job_lines_give_nodes_cpus_and_gpus() {
        let text = "JobId=7 JobName=x NodeList=a[1-3] NumCPUs=20 JOB_GRES=gpu:4   Nodes=a[1-2] CPU_IDs=0-3,8 Mem=0 \
                    GRES=gpu:a100:2(IDX:0-1),nic:1   Nodes=a3 CPU_IDs=0-9 Mem=0 GRES= MinCPUsNode=1";
        let n = parse_job_nodes(text, "gpu").unwrap();
        assert_eq!(n, [("a[1-2]".to_string(), 5, 2), ("a3".to_string(), 10, 0)]);
        assert!(parse_job_nodes("JobId=7 JobState=PENDING", "gpu").is_err());
        assert_eq!(gpus_in("gpu:1(IDX:0),gpu:tesla:2(IDX:1-2)", "gpu"), 3);
        assert_eq!(count_ids("4-2"), None);
    }
}
