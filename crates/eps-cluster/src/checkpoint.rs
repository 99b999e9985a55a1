//! Checkpoints from the command line: `eps checkpoint` (one now, through the
//! control plane), the `--checkpoint-*` flags of `eps train`, and the spec a
//! job resumes with (`eps train --resume`, `eps control --resume`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use eps_proto::JobSpec;
use eps_proto::control::ControlMsg;
use eps_proto::spec::ResumeSection;

use crate::error::chain as crate_error;
use crate::jobspec::{Overrides, build_spec_or};
use crate::secret::from_env as secret_from_env;

/// `path` made absolute against the current directory (servers and the
/// control plane may run from elsewhere).
pub fn absolute(path: &Path) -> Result<PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The spec of a job resumed from the newest complete checkpoint in `dir` (or
/// the checkpoint `dir` itself): the checkpoint's spec with `o` applied (other
/// worker or server counts, more steps) and a `[resume]` section. Says why
/// when the checkpoint cannot be resumed with those changes.
pub fn resume_spec(dir: &Path, o: &Overrides) -> Result<(JobSpec, String), String> {
    let dir = absolute(dir)?;
    let (path, m) = eps_control::checkpoint::latest(&dir)?;
    // The same values are welcome (the command line that started the job,
    // with --resume added); others are not the checkpoint's job.
    let (saved, _) = crate::jobspec::parse(&m.spec).map_err(|e| format!("{}: {e}", path.display()))?;
    let kept = [
        ("--dtype", o.dtype.as_deref(), saved.job.dtype.to_string()),
        ("--optimizer", o.optimizer.as_deref(), saved.optimizer.kind.clone()),
        ("--consistency", o.consistency.as_deref(), saved.job.consistency.name().to_string()),
    ];
    for (flag, given, was) in kept {
        if given.is_some_and(|g| !g.eq_ignore_ascii_case(&was)) {
            return Err(format!(
                "{flag} {}: the checkpoint's job has {was}, and a resumed job keeps it (it is part of the checkpoint)",
                given.unwrap_or_default()
            ));
        }
    }
    let (base, text) = build_spec_or(None, &m.spec, o).map_err(|e| crate_error(&e))?;
    let layout = base.layout().map_err(|e| e.to_string())?;
    if layout.total != m.total {
        return Err(format!("{}: holds {} parameters; this job has {}", path.display(), m.total, layout.total));
    }
    let r = ResumeSection { from: path.display().to_string(), iteration: m.version, membership: m.membership.clone() };
    let text = JobSpec::set_resume(&text, Some(&r)).map_err(|e| e.to_string())?;
    let spec = JobSpec::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    eps_proto::say!(
        "eps: resuming job {:?} at iteration {} of {} from {}",
        spec.job.name,
        m.version,
        spec.job.steps,
        path.display()
    );
    Ok((spec, text))
}

/// Sets the checkpoint fields of `o`'s spec from `eps train`'s flags (the
/// directory made absolute).
pub fn train_overrides(every: Option<u64>, dir: Option<&Path>, keep: Option<u32>, o: &mut Overrides) -> Result<(), String> {
    o.checkpoint_every = every;
    o.checkpoint_dir = dir.map(absolute).transpose()?.map(|p| p.display().to_string());
    o.checkpoint_keep = keep;
    if every.is_some_and(|n| n > 0) && dir.is_none() {
        return Err("--checkpoint-every needs --checkpoint-dir DIR".into());
    }
    Ok(())
}

/// `eps checkpoint`: asks the control plane for a checkpoint now and waits
/// until it is complete.
pub fn take(control: eps_control::ControlAddrs, dir: Option<&Path>, timeout: Duration) -> Result<(), String> {
    let secret = secret_from_env(None)?;
    let dir = dir.map(absolute).transpose()?.map(|p| p.display().to_string()).unwrap_or_default();
    let mut c = eps_control::ControlClient::connect(&control, &secret, timeout).map_err(|e| crate_error(&e))?;
    eps_proto::say!("eps checkpoint: asking the job at {control} for a checkpoint");
    // A job still starting takes the request once its servers are ready.
    let deadline = std::time::Instant::now() + timeout;
    let answer =
        c.call_when_possible(&ControlMsg::Checkpoint { version: 0, dir: dir.clone() }, deadline).map_err(|e| crate_error(&e))?;
    match answer {
        ControlMsg::Checkpointed { version, path } => {
            println!("checkpoint at iteration {version} in {path}");
            Ok(())
        }
        m => Err(format!("unexpected answer from the control plane: {m:?}")),
    }
}
