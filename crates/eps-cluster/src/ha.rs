//! `eps control --store etcd://...`: one of a job's control planes, whose
//! state lives in etcd. It campaigns to lead the job; until it does it
//! stands by (its address answers that it does not lead, and who does);
//! once leading it replays the job's log from etcd and serves. A leader
//! whose lease runs out steps down (it exits; a launcher restarts it as a
//! standby), and its writes are fenced meanwhile.

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use eps_control::ControlService;
use eps_etcd::election::{self, Leadership};
use eps_etcd::store::{self as etcd, EtcdStore, EtcdTarget};
use eps_proto::JobSpec;

use crate::advertise::ready_line;
use crate::error::chain as crate_error;
use crate::secret::from_env as secret_from_env;

/// The lease of the leader key, in seconds: how long a dead leader keeps
/// the job without a control plane (etcd grants no less than 2).
pub const LEASE_S: i64 = 3;

/// The job's name must be one segment of an etcd key.
fn check_job_name(name: &str) -> Result<(), String> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) || name == "." || name == ".." {
        return Err(format!(
            "job name {name:?} cannot name the job's keys in etcd: use letters, digits, -, _ and . ([job] name)"
        ));
    }
    Ok(())
}

/// Connects to etcd and claims the job's keys for this job's secret.
pub fn open(target: &EtcdTarget, spec: &JobSpec, secret: &eps_fabric::Secret) -> Result<eps_etcd::Client, String> {
    check_job_name(&spec.job.name)?;
    let mut c = target.connect().map_err(|e| format!("--store {target}: {e}"))?;
    let owner: String = eps_fabric::auth::fingerprint(secret, b"etcd job owner").iter().map(|b| format!("{b:02x}")).collect();
    etcd::claim(&mut c, target, &spec.job.name, owner.as_bytes())?;
    Ok(c)
}

/// Removes a finished job's keys (a launcher's throwaway job).
pub fn discard(target: &EtcdTarget, job: &str) -> Result<(), String> {
    let mut c = target.connect().map_err(|e| e.to_string())?;
    c.delete_prefix(&target.job_prefix(job)).map(drop).map_err(|e| e.to_string())
}

/// `eps control --store etcd://...`.
pub fn control(listen: SocketAddr, spec: &JobSpec, text: &str, target: &EtcdTarget) -> Result<(), String> {
    let secret = secret_from_env(Some(spec))?;
    let mut c = open(target, spec, &secret)?;
    let job = spec.job.name.clone();
    let base = target.job_prefix(&job);
    let listener = TcpListener::bind(listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = ready_line(listener.local_addr().map_err(|e| e.to_string())?);
    let me = format!("{addr} (pid {})", std::process::id());
    eps_proto::say!("eps control: job {job:?} on {addr}: state in {target}; campaigning to lead it");
    let leader_gauge =
        eps_metrics::global().gauge("eps_control_leader", "1 while this control plane serves the job.", &[("job", job.as_str())]);
    leader_gauge.set(0.0);

    // Until elected: a standby's answers on the address.
    let told = Arc::new(Mutex::new(String::new()));
    let standing = Arc::new(AtomicBool::new(false));
    let standby = eps_control::standby::serve(&listener, secret.clone(), job.clone(), told.clone(), standing.clone())
        .map_err(|e| format!("cannot serve as a standby: {e}"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let since = Instant::now();
    let mut standing_by = |holder: &str| {
        if let Ok(mut t) = told.lock() {
            *t = holder.to_string();
        }
        eps_proto::say!("eps control: standing by: job {job:?} is led by {holder}");
    };
    let won = election::campaign(&mut c, &base, &me, LEASE_S, &AtomicBool::new(false), stop.clone(), &mut standing_by);
    standing.store(true, Ordering::Release);
    let _ = standby.join();
    let lead: Leadership = won.map_err(|e| format!("--store {target}: {e}"))?.ok_or("the campaign was called off")?;
    let waited_ms = since.elapsed().as_millis() as u64;
    eps_proto::say_event!(
        "leader_elected",
        { job = job.as_str(), addr = addr.to_string().as_str(), pid = std::process::id(), fence = lead.fence, waited_ms = waited_ms },
        "eps control: leading job {job:?} from {addr} (elected after {waited_ms} ms; fence revision {}); replaying its state from etcd",
        lead.fence
    );
    let store = EtcdStore::new(c, base, lead.fence);
    let replay = Instant::now();
    let svc = match ControlService::on(listener, spec, text, secret, Box::new(store)) {
        Ok(s) => s,
        Err(e) => {
            lead.resign();
            return Err(crate_error(&e));
        }
    };
    let f = svc.figures();
    eps_proto::say!(
        "eps control: serving job {job:?} (state replayed in {} ms: epoch {}, iteration {}, {} migrations in flight)",
        replay.elapsed().as_millis(),
        f.epoch,
        f.iteration,
        f.migrations_in_flight
    );
    let served = svc.run_until(&stop);
    leader_gauge.set(0.0);
    if lead.lost() {
        eps_proto::say_event!(
            "leader_deposed",
            { job = job.as_str(), addr = addr.to_string().as_str(), pid = std::process::id(), fence = lead.fence },
            "eps control: deposed: the lease of job {job:?}'s leader key ran out"
        );
        return Err(format!(
            "deposed: this control plane's lease in etcd ran out, so another may lead job {job:?} now; stepping down \
             (start it again to stand by)"
        ));
    }
    lead.resign();
    served.map_err(|e| crate_error(&e))
}
