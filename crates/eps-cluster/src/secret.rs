//! The job secret: where a role reads it (never the command line, which
//! other users of the machine can see), and the file a local cluster writes it
//! to for the commands that reach the job later.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use eps_fabric::Secret;
use eps_proto::JobSpec;

/// The job secret from the environment (never from the command line, where other
/// users of the machine could read it): `EPS_JOB_SECRET`, else the file named by
/// `EPS_JOB_SECRET_FILE` (as `eps up` writes it), else the spec's.
pub fn from_env(spec: Option<&JobSpec>) -> Result<Secret, String> {
    let mut s = std::env::var("EPS_JOB_SECRET").ok().filter(|s| !s.is_empty());
    if s.is_none()
        && let Some(path) = std::env::var_os("EPS_JOB_SECRET_FILE")
    {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read the job secret from EPS_JOB_SECRET_FILE={}: {e}", path.to_string_lossy()))?;
        s = Some(text.trim().to_string());
    }
    let s = s.or_else(|| spec.and_then(|s| s.job.secret.clone()));
    let s = s.ok_or("no job secret: set EPS_JOB_SECRET or EPS_JOB_SECRET_FILE (or job.secret in the spec)")?;
    Secret::new(s).map_err(|e| e.to_string())
}

/// Writes the secret into a cluster's directory `dir` (made this user's
/// alone), as `job.secret`, readable by this user only.
pub fn write(dir: &Path, secret: &str) -> Result<PathBuf, String> {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot restrict {}: {e}", dir.display()))?;
    let path = dir.join("job.secret");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    f.write_all(secret.as_bytes()).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}
