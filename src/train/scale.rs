//! Scripted scale events of `eps train --scale-plan "STEP:servers=N,..."`: a
//! thread follows the training step, asks the control plane to scale at each event
//! (retrying while an earlier event's migrations run), has the driver start the new
//! server processes, and counts the migrations the events caused.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eps_control::{ControlClient, ControlError};
use eps_fabric::Secret;
use eps_proto::control::ControlMsg;

/// One scripted event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleEvent {
    /// Applied once rank 0 has finished this many steps.
    pub step: u64,
    /// Wanted server count.
    pub servers: u32,
}

/// Parses `STEP:servers=N[,STEP:servers=N...]`, steps ascending.
pub fn parse_plan(text: &str) -> Result<Vec<ScaleEvent>, String> {
    let mut out: Vec<ScaleEvent> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = |why: &str| format!("--scale-plan item {item:?}: {why} (expected STEP:servers=N, e.g. 200:servers=3)");
        let (step, what) = item.split_once(':').ok_or_else(|| bad("no ':'"))?;
        let step: u64 = step.trim().parse().map_err(|_| bad("the step is not a whole number"))?;
        let (key, value) = what.split_once('=').ok_or_else(|| bad("no '='"))?;
        let n: u32 = value.trim().parse().map_err(|_| bad("the count is not a whole number"))?;
        match key.trim() {
            "servers" if n >= 1 => {}
            "servers" => return Err(bad("a job needs at least one server")),
            "workers" => {
                return Err(bad("changing the worker count of a running job is not supported yet; only servers=N"));
            }
            _ => return Err(bad("unknown resource (only servers)")),
        }
        if out.last().is_some_and(|e| e.step > step) {
            return Err(bad("steps must be in ascending order"));
        }
        out.push(ScaleEvent { step, servers: n });
    }
    Ok(out)
}

/// What the scale thread reports at the end.
#[derive(Clone, Debug, Default)]
pub struct ScaleOutcome {
    /// Events applied.
    pub events: u64,
    /// Migrations done (from the control plane's status).
    pub migrations: u64,
    /// The first error, if any.
    pub error: Option<String>,
}

/// Runs the plan on a thread: `step` is rank 0's finished steps, `spawn` asks the
/// driver to start that many more servers.
pub fn spawn_plan(
    plan: Vec<ScaleEvent>,
    control: SocketAddr,
    secret: Secret,
    initial_servers: u32,
    step: Arc<AtomicU64>,
    spawn: Sender<u32>,
) -> Arc<Mutex<ScaleOutcome>> {
    let outcome = Arc::new(Mutex::new(ScaleOutcome::default()));
    let out = outcome.clone();
    std::thread::spawn(move || {
        let r = run_plan(&plan, control, &secret, initial_servers, &step, &spawn, &out);
        if let Err(e) = r {
            out.lock().unwrap_or_else(|p| p.into_inner()).error = Some(e);
        }
    });
    outcome
}

fn run_plan(
    plan: &[ScaleEvent],
    control: SocketAddr,
    secret: &Secret,
    mut servers: u32,
    step: &AtomicU64,
    spawn: &Sender<u32>,
    out: &Mutex<ScaleOutcome>,
) -> Result<(), String> {
    let mut ctl = ControlClient::connect(control, secret, Duration::from_secs(30)).map_err(|e| e.to_string())?;
    for ev in plan {
        while step.load(Ordering::Acquire) < ev.step {
            std::thread::sleep(Duration::from_millis(2));
        }
        // Retry while an earlier event's migrations are still running.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match ctl.call(&ControlMsg::Scale { servers: ev.servers }) {
                Ok(_) => break,
                Err(ControlError::Rejected(m)) if m.contains("in progress") && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(format!("scale event at step {} (servers={}): {e}", ev.step, ev.servers)),
            }
        }
        eprintln!("eps train: step {}: scaling servers {servers} -> {}", step.load(Ordering::Acquire), ev.servers);
        if ev.servers > servers {
            let _ = spawn.send(ev.servers - servers);
        }
        let moves = ev.servers != servers;
        servers = ev.servers;
        let before = {
            let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
            o.events += 1;
            o.migrations
        };
        wait_migrations(&mut ctl, out, if moves { before + 1 } else { before });
    }
    Ok(())
}

/// Follows `eps status` until no migration is in flight, no server is joining and
/// at least `min_done` are done (or the job ended), recording the number done.
fn wait_migrations(ctl: &mut ControlClient, out: &Mutex<ScaleOutcome>, min_done: u64) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        let Ok(ControlMsg::StatusReport { text }) = ctl.call(&ControlMsg::Status) else { return };
        let Some(line) = text.lines().find(|l| l.starts_with("migrations:")) else { return };
        let nums: Vec<u64> = line.split(|c: char| !c.is_ascii_digit()).filter_map(|x| x.parse().ok()).collect();
        if let [in_flight, done, ..] = nums[..] {
            out.lock().unwrap_or_else(|p| p.into_inner()).migrations = done;
            let joining = text.lines().any(|l| l.contains(": joining,"));
            if in_flight == 0 && !joining && done >= min_done {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_bad_ones_say_why() {
        assert_eq!(
            parse_plan("100:servers=3, 300:servers=1").unwrap(),
            vec![ScaleEvent { step: 100, servers: 3 }, ScaleEvent { step: 300, servers: 1 }]
        );
        assert!(parse_plan("").unwrap().is_empty());
        for (bad, why) in [
            ("x:servers=3", "whole number"),
            ("100servers=3", "no ':'"),
            ("100:servers=0", "at least one"),
            ("100:gpus=2", "unknown resource"),
            ("100:workers=3", "not supported yet"),
            ("300:servers=2,100:servers=3", "ascending"),
        ] {
            let e = parse_plan(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
