//! `eps slurm script`: an sbatch script that runs a job through Slurm. The
//! allocation it asks for covers the job's roles (a task per server and
//! worker, the CPUs and GPUs of the spec's `[slurm]`); the script carries the
//! spec, makes a fresh job secret and runs `eps train --launcher slurm`.

use std::path::PathBuf;

use crate::train::scale::Target;
use crate::train::{Overrides, build_model_spec, default_spec};

/// `eps slurm script`'s arguments.
#[derive(clap::Args, Debug)]
pub struct ScriptArgs {
    /// Job spec (TOML); without it, the built-in job of --model.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// The built-in job (`synthetic`, `ctr`); with --spec, its preset.
    #[arg(long, default_value = "synthetic")]
    pub model: String,
    /// Servers the job may grow to while it runs (tasks are asked for them)
    /// [default: the most a --scale-plan after `--` asks for].
    #[arg(long, value_name = "N")]
    pub max_servers: Option<u32>,
    /// Wall time (`#SBATCH --time`).
    #[arg(long, default_value = "1:00:00")]
    pub time: String,
    /// Nodes (`#SBATCH --nodes`) [default: as Slurm fits the tasks].
    #[arg(long)]
    pub nodes: Option<u32>,
    /// Partition (`#SBATCH --partition`).
    #[arg(long)]
    pub partition: Option<String>,
    /// Account (`#SBATCH --account`).
    #[arg(long)]
    pub account: Option<String>,
    /// Where the job's output goes (`#SBATCH --output`).
    #[arg(long, default_value = "eps-%j.out")]
    pub output: String,
    /// The eps binary on the nodes [default: this one's path].
    #[arg(long)]
    pub eps: Option<PathBuf>,
    /// Flags for `eps train` (after `--`).
    #[arg(last = true)]
    pub train_args: Vec<String>,
}

/// The `--scale-plan` among `eps train`'s flags.
fn scale_plan(args: &[String]) -> Result<Vec<crate::train::scale::ScaleEvent>, String> {
    let mut text = None;
    for (i, x) in args.iter().enumerate() {
        if x == "--scale-plan" {
            text = Some(args.get(i + 1).ok_or("--scale-plan after `--` needs a value")?.clone());
        } else if let Some(v) = x.strip_prefix("--scale-plan=") {
            text = Some(v.to_string());
        }
    }
    crate::train::scale::parse_plan(text.as_deref().unwrap_or(""))
}

/// Quotes `s` for a POSIX shell.
fn quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The end-of-spec marker of the script's here-document.
const END: &str = "EPS_SPEC_END";

/// The script for `a`.
pub fn script_text(a: &ScriptArgs) -> Result<String, String> {
    let default = default_spec(&a.model)?;
    let (spec, text) =
        build_model_spec(a.spec.as_deref(), default, &Overrides::default()).map_err(|e| crate::error::chain(&e))?;
    let kind = crate::jobspec::TaskSection::of(&spec).map_err(|e| e.to_string())?.map(|t| t.kind).unwrap_or_default();
    if kind != a.model {
        return Err(format!("the spec's model.preset is {kind:?} but --model is {:?}: give --model {kind}", a.model));
    }
    if text.lines().any(|l| l.trim() == END) {
        return Err(format!("the spec has a line {END:?}, which ends the script's copy of it"));
    }
    let sl = &spec.slurm;
    // Steps wait for free CPUs: ask for the most roles that run at once.
    let plan = scale_plan(&a.train_args)?;
    let most = |f: fn(&Target) -> Option<u32>| plan.iter().filter_map(|e| f(&e.target)).max().unwrap_or(0);
    let planned_servers = most(|t| if let Target::Servers(n) = t { Some(*n) } else { None });
    let planned_workers = most(|t| if let Target::Workers(n) = t { Some(*n) } else { None });
    let servers = a.max_servers.unwrap_or(0).max(planned_servers).max(spec.job.servers);
    let workers = spec.job.workers.max(planned_workers);
    let gpus = servers * sl.server_gpus + workers * sl.worker_gpus;
    let exe = match &a.eps {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| format!("cannot find this eps binary's path ({e}); give --eps PATH"))?,
    };
    let exe = exe.to_str().ok_or("the eps binary's path is not UTF-8; give --eps PATH")?.to_string();
    let mut s = String::from("#!/bin/bash\n");
    s.push_str(&format!(
        "# EPS job {:?} through Slurm (written by `eps slurm script`): the control plane,\n\
         # {} servers (up to {servers}) and {} workers (up to {workers} at once) each run as a job step.\n",
        spec.job.name, spec.job.servers, spec.job.workers
    ));
    let clean: String =
        spec.job.name.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    s.push_str(&format!("#SBATCH --job-name=eps-{clean}\n"));
    s.push_str(&format!("#SBATCH --ntasks={}\n", servers + workers));
    s.push_str(&format!("#SBATCH --cpus-per-task={}\n", sl.server_cpus.max(sl.worker_cpus)));
    if gpus > 0 {
        s.push_str(&format!("#SBATCH --gpus={gpus}\n"));
    }
    if let Some(n) = a.nodes {
        s.push_str(&format!("#SBATCH --nodes={n}\n"));
    }
    for (flag, v) in [("partition", &a.partition), ("account", &a.account)] {
        if let Some(v) = v {
            s.push_str(&format!("#SBATCH --{flag}={}\n", quote(v)));
        }
    }
    s.push_str(&format!("#SBATCH --time={}\n#SBATCH --output={}\n", quote(&a.time), quote(&a.output)));
    s.push_str(
        "set -euo pipefail\n\
         # A fresh job secret, in the environment of this script and its steps only.\n\
         EPS_JOB_SECRET=\"$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')\"\n\
         export EPS_JOB_SECRET\n\
         spec=\"$(mktemp \"${TMPDIR:-/tmp}/eps-spec.XXXXXX\")\"\n\
         trap 'rm -f \"$spec\"' EXIT\n",
    );
    s.push_str(&format!("cat > \"$spec\" <<'{END}'\n{}", text));
    if !text.ends_with('\n') {
        s.push('\n');
    }
    s.push_str(&format!("{END}\n"));
    let mut cmd = vec![quote(&exe), "train".into(), "--launcher".into(), "slurm".into(), "--model".into(), quote(&a.model)];
    cmd.extend(["--spec".into(), "\"$spec\"".into(), "--json".into()]);
    cmd.extend(a.train_args.iter().map(|x| quote(x)));
    s.push_str(&cmd.join(" "));
    s.push('\n');
    Ok(s)
}

/// `eps slurm script`: prints the script.
pub fn script(a: &ScriptArgs) -> Result<(), String> {
    print!("{}", script_text(a)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(spec: Option<PathBuf>, train: &[&str]) -> ScriptArgs {
        ScriptArgs {
            spec,
            model: "synthetic".into(),
            max_servers: Some(3),
            time: "0:30:00".into(),
            nodes: Some(2),
            partition: Some("gpu a".into()),
            account: None,
            output: "eps-%j.out".into(),
            eps: Some("/opt/eps/bin/eps".into()),
            train_args: train.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn the_script_asks_for_every_role_and_carries_the_spec() {
        let dir = std::env::temp_dir().join(format!("eps-script-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("job.toml");
        let spec = crate::train::DEFAULT_SPEC.replace("shard_bytes", "max_workers = 4\nshard_bytes")
            + "\n[slurm]\nserver_cpus = 2\nworker_cpus = 4\nserver_gpus = 1\n";
        std::fs::write(&p, &spec).unwrap();
        let t = script_text(&args(Some(p.clone()), &["--scale-plan", "100:servers=3", "it's"])).unwrap();
        assert!(t.contains("#SBATCH --ntasks=5\n"), "{t}");
        assert!(t.contains("#SBATCH --cpus-per-task=4\n"));
        assert!(t.contains("#SBATCH --gpus=3\n"));
        // Room for what the plan grows to.
        let grown = script_text(&args(Some(p.clone()), &["--scale-plan=9:servers=5,20:workers=6"])).unwrap();
        assert!(grown.contains("#SBATCH --ntasks=11\n") && grown.contains("#SBATCH --gpus=5\n"), "{grown}");
        assert!(t.contains("#SBATCH --nodes=2\n#SBATCH --partition='gpu a'\n"));
        assert!(t.contains("[slurm]") && t.contains("server_cpus = 2"));
        let last = t.lines().last().unwrap();
        assert_eq!(
            last,
            "/opt/eps/bin/eps train --launcher slurm --model synthetic --spec \"$spec\" --json --scale-plan 100:servers=3 'it'\\''s'"
        );
        // The spec it carries is the one given.
        let body = t.split(&format!("<<'{END}'\n")).nth(1).unwrap().split(&format!("\n{END}\n")).next().unwrap();
        let back = eps_proto::JobSpec::from_toml(body).unwrap();
        assert_eq!((back.slurm.worker_cpus, back.job.max_workers), (4, Some(4)));
        std::fs::write(&p, format!("{spec}\n# x\n")).unwrap();
        let e = script_text(&ScriptArgs { model: "ctr".into(), ..args(Some(p), &[]) }).unwrap_err();
        assert!(e.contains("--model synthetic"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
