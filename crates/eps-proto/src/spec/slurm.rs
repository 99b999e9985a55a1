//! `[slurm]`: what each role's Slurm job step asks for when a job runs
//! through Slurm (`eps train --launcher slurm`, `eps slurm script`).

use serde::Deserialize;

use super::{SpecError, bad};

/// `[slurm]`. Every field is optional; other launchers ignore the section.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmSection {
    /// CPUs of each server's step (`srun -c`).
    #[serde(default = "one")]
    pub server_cpus: u32,
    /// CPUs of each worker's step.
    #[serde(default = "one")]
    pub worker_cpus: u32,
    /// GPUs of each server's step (`--gres=GRES:N`; for `--aggregator cuda`).
    #[serde(default)]
    pub server_gpus: u32,
    /// GPUs of each worker's step.
    #[serde(default)]
    pub worker_gpus: u32,
    /// The GRES name of a GPU in the cluster's slurm.conf.
    #[serde(default = "gpu")]
    pub gpu_gres: String,
    /// Steps share the allocation's CPUs (`srun --overlap`) instead of each
    /// holding its own: for allocations smaller than the job's roles. The
    /// control plane's step always overlaps (it is never on the data path).
    #[serde(default)]
    pub overlap: bool,
    /// The control plane's port on its node (0: any; the launcher reads the
    /// one it got).
    #[serde(default)]
    pub control_port: u16,
    /// The directory on the control plane's node for its state log (one
    /// directory per job under it).
    #[serde(default = "tmp")]
    pub state_dir: String,
    /// More `srun` flags for every step (e.g. `--mem-per-cpu=4G`).
    #[serde(default)]
    pub step_args: Vec<String>,
}

fn one() -> u32 {
    1
}

fn gpu() -> String {
    "gpu".into()
}

fn tmp() -> String {
    "/tmp".into()
}

impl Default for SlurmSection {
    fn default() -> Self {
        toml::from_str("").expect("defaults parse")
    }
}

impl SlurmSection {
    /// Checks every value.
    pub fn validate(&self) -> Result<(), SpecError> {
        if !(1..=1024).contains(&self.server_cpus) {
            return Err(bad("slurm.server_cpus", "must be between 1 and 1024"));
        }
        if !(1..=1024).contains(&self.worker_cpus) {
            return Err(bad("slurm.worker_cpus", "must be between 1 and 1024"));
        }
        if self.server_gpus > 64 || self.worker_gpus > 64 {
            return Err(bad("slurm.server_gpus", "at most 64 GPUs a step"));
        }
        let plain = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-".contains(c));
        if !plain(&self.gpu_gres) {
            return Err(bad("slurm.gpu_gres", format!("{:?}: a GRES name such as \"gpu\"", self.gpu_gres)));
        }
        if !self.state_dir.starts_with('/') {
            return Err(bad("slurm.state_dir", format!("{:?}: must be an absolute path", self.state_dir)));
        }
        if let Some(a) = self.step_args.iter().find(|a| !a.starts_with('-')) {
            return Err(bad("slurm.step_args", format!("{a:?}: srun flags only, each one whole (\"--mem-per-cpu=4G\")")));
        }
        Ok(())
    }

    /// The `srun` resource flags of a server's (`true`) or a worker's step.
    pub fn step_flags(&self, server: bool) -> Vec<String> {
        let (cpus, gpus) = if server { (self.server_cpus, self.server_gpus) } else { (self.worker_cpus, self.worker_gpus) };
        let mut v = vec![format!("--cpus-per-task={cpus}")];
        if gpus > 0 {
            v.push(format!("--gres={}:{gpus}", self.gpu_gres));
        }
        if self.overlap {
            v.push("--overlap".into());
        }
        v.extend(self.step_args.iter().cloned());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_ask_one_cpu_a_role_and_flags_follow_the_section() {
        let s = SlurmSection::default();
        assert_eq!(s.step_flags(true), ["--cpus-per-task=1"]);
        let s: SlurmSection =
            toml::from_str("server_cpus = 4\nserver_gpus = 2\noverlap = true\nstep_args = [\"--mem-per-cpu=2G\"]").unwrap();
        s.validate().unwrap();
        assert_eq!(s.step_flags(true), ["--cpus-per-task=4", "--gres=gpu:2", "--overlap", "--mem-per-cpu=2G"]);
        assert_eq!(s.step_flags(false), ["--cpus-per-task=1", "--overlap", "--mem-per-cpu=2G"]);
    }

    #[test]
    fn bad_values_name_their_field() {
        for (t, field) in [
            ("worker_cpus = 0", "slurm.worker_cpus"),
            ("gpu_gres = \"gpu:a100 x\"", "slurm.gpu_gres"),
            ("state_dir = \"rel\"", "slurm.state_dir"),
            ("step_args = [\"mem\"]", "slurm.step_args"),
        ] {
            let s: SlurmSection = toml::from_str(t).unwrap();
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(field), "{t}: {e}");
        }
    }
}
