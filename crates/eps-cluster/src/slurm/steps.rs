//! A cluster's roles as Slurm job steps: each process `eps train` (or the
//! scheduler) would start on this machine is started with `srun` inside the
//! allocation instead, one role per step, with the CPUs and GPUs the spec's
//! `[slurm]` asks for, on a node Slurm picks (or the one the scheduler
//! placed it on).

use std::path::Path;
use std::process::Command;

use eps_proto::spec::SlurmSection;

/// Which role a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `eps control`.
    Control,
    /// `eps server`.
    Server,
    /// `eps worker`.
    Worker,
}

/// Starts a job's roles as steps of the allocation this process runs in.
#[derive(Clone, Debug)]
pub struct Steps {
    job: String,
    section: SlurmSection,
    /// Step names are `PREFIX-ROLE-N`.
    prefix: String,
}

impl Steps {
    /// For a job named `name` with the spec's `[slurm]`, in the allocation of
    /// `SLURM_JOB_ID`; fails, saying what to do, outside one or without `srun`.
    pub fn in_allocation(name: &str, section: &SlurmSection) -> Result<Self, String> {
        let job = super::job_id()?;
        super::slurm_cmd("srun", &["--version"])?;
        let clean: String = name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let prefix = if clean.is_empty() { "eps".to_string() } else { format!("eps-{clean}") };
        Ok(Self { job, section: section.clone(), prefix })
    }

    /// The allocation's job id.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// The directory of the control plane's state on its node, for the
    /// cluster tagged `tag`.
    pub fn state_dir(&self, tag: &str) -> String {
        format!("{}/eps-state-{}-{tag}", self.section.state_dir.trim_end_matches('/'), self.job)
    }

    /// The control plane's listen address: every interface of its node.
    pub fn control_listen(&self) -> String {
        format!("0.0.0.0:{}", self.section.control_port)
    }

    /// The step name of the `n`th process of `role`.
    pub fn step_name(&self, role: Role, n: u32) -> String {
        let r = match role {
            Role::Control => "control",
            Role::Server => "server",
            Role::Worker => "worker",
        };
        format!("{}-{r}-{n}", self.prefix)
    }

    /// `srun ... EXE ARGS`: the `n`th process of `role` as a step, on `node`
    /// when given. The step inherits this process's environment (the job
    /// secret included); its output comes back through `srun`.
    pub fn command(&self, exe: &Path, role: Role, n: u32, node: Option<&str>, args: &[String]) -> Command {
        let mut c = Command::new("srun");
        c.arg(format!("--jobid={}", self.job)).arg(format!("--job-name={}", self.step_name(role, n))).args([
            "--nodes=1",
            "--ntasks=1",
            "--exact",
            "--kill-on-bad-exit=1",
        ]);
        match role {
            // Light and never on the data path: it takes no CPU from the roles.
            Role::Control => {
                c.args(["--cpus-per-task=1", "--overlap"]).args(&self.section.step_args);
            }
            Role::Server => {
                c.args(self.section.step_flags(true));
            }
            Role::Worker => {
                c.args(self.section.step_flags(false));
            }
        }
        if let Some(n) = node {
            c.arg(format!("--nodelist={n}"));
        }
        c.arg(exe).args(args);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_asks_for_its_role_resources_on_the_job() {
        let section: SlurmSection = toml::from_str("server_gpus = 1\nstep_args = [\"--mem=1G\"]").unwrap();
        let s = Steps { job: "42".into(), section, prefix: "eps-ctr".into() };
        let c = s.command(Path::new("/opt/eps"), Role::Server, 3, Some("n2"), &["server".into()]);
        let args: Vec<String> = c.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(c.get_program(), "srun");
        assert_eq!(
            args,
            [
                "--jobid=42",
                "--job-name=eps-ctr-server-3",
                "--nodes=1",
                "--ntasks=1",
                "--exact",
                "--kill-on-bad-exit=1",
                "--cpus-per-task=1",
                "--gres=gpu:1",
                "--mem=1G",
                "--nodelist=n2",
                "/opt/eps",
                "server"
            ]
        );
        let c = s.command(Path::new("/opt/eps"), Role::Control, 0, None, &[]);
        assert!(c.get_args().any(|a| a == "--overlap"));
        assert_eq!(s.state_dir("ab"), "/tmp/eps-state-42-ab");
    }
}
