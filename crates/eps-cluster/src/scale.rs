//! Scripted scale events of `eps train --scale-plan "STEP:servers=N,STEP:workers=M,..."`:
//! a thread follows the training step, asks the control plane to scale at each
//! event (retrying while an earlier event is still under way), has the driver start
//! the new server and worker processes, and counts the migrations the events caused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eps_control::ControlClient;
use eps_fabric::Secret;
use eps_proto::control::ControlMsg;

/// What one event changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Wanted server count.
    Servers(u32),
    /// Wanted worker count.
    Workers(u32),
}

/// One scripted event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleEvent {
    /// Applied once rank 0 has finished this many steps.
    pub step: u64,
    /// What it changes.
    pub target: Target,
}

impl ScaleEvent {
    /// The worker count this event asks for, if it is a worker event.
    pub fn workers(&self) -> Option<u32> {
        match self.target {
            Target::Workers(n) => Some(n),
            Target::Servers(_) => None,
        }
    }
}

/// Processes the driver must start for an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spawn {
    /// This many more servers.
    Servers(u32),
    /// This many more workers.
    Workers(u32),
}

/// Parses `STEP:servers=N` / `STEP:workers=N` items separated by commas, steps ascending.
pub fn parse_plan(text: &str) -> Result<Vec<ScaleEvent>, String> {
    let mut out: Vec<ScaleEvent> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = |why: &str| {
            format!("--scale-plan item {item:?}: {why} (expected STEP:servers=N or STEP:workers=N, e.g. 200:servers=3)")
        };
        let (step, what) = item.split_once(':').ok_or_else(|| bad("no ':'"))?;
        let step: u64 = step.trim().parse().map_err(|_| bad("the step is not a whole number"))?;
        let (key, value) = what.split_once('=').ok_or_else(|| bad("no '='"))?;
        let n: u32 = value.trim().parse().map_err(|_| bad("the count is not a whole number"))?;
        let target = match key.trim() {
            "servers" if n >= 1 => Target::Servers(n),
            "servers" => return Err(bad("a job needs at least one server")),
            "workers" if n >= 1 => Target::Workers(n),
            "workers" => return Err(bad("a job needs at least one worker")),
            _ => return Err(bad("unknown resource (servers or workers)")),
        };
        if out.last().is_some_and(|e| e.step > step) {
            return Err(bad("steps must be in ascending order"));
        }
        out.push(ScaleEvent { step, target });
    }
    Ok(out)
}

/// Worker ranks a plan needs over the job's life, starting from `workers`
/// (joins take new ranks; leaves free none).
pub fn ranks_needed(plan: &[ScaleEvent], workers: u32) -> u32 {
    let (mut now, mut ranks) = (workers, workers);
    for n in plan.iter().filter_map(ScaleEvent::workers) {
        ranks += n.saturating_sub(now);
        now = n;
    }
    ranks
}

/// What the scale thread reports at the end.
#[derive(Clone, Debug, Default)]
pub struct ScaleOutcome {
    /// Events applied.
    pub events: u64,
    /// Migrations done (from the control plane's status).
    pub migrations: u64,
    /// Shard splits done (from the control plane's status).
    pub splits: u64,
    /// Bucket moves of sparse tables done (from the control plane's status).
    pub bucket_moves: u64,
    /// The first error, if any.
    pub error: Option<String>,
}

/// Runs the plan on a thread: `step` is rank 0's finished steps, `spawn` asks the
/// driver to start more processes; `initial` is (servers, workers) at the start;
/// `tables`: the job has sparse tables, whose buckets move at every change of
/// servers (an event waits for that move too before the next is made).
pub fn spawn_plan(
    plan: Vec<ScaleEvent>,
    control: eps_control::ControlAddrs,
    secret: Secret,
    initial: (u32, u32),
    tables: bool,
    step: Arc<AtomicU64>,
    spawn: Sender<Spawn>,
) -> Arc<Mutex<ScaleOutcome>> {
    let outcome = Arc::new(Mutex::new(ScaleOutcome::default()));
    let out = outcome.clone();
    std::thread::spawn(move || {
        let r = run_plan(&plan, control, &secret, (initial, tables), &step, &spawn, &out);
        if let Err(e) = r {
            out.lock().unwrap_or_else(|p| p.into_inner()).error = Some(e);
        }
    });
    outcome
}

fn run_plan(
    plan: &[ScaleEvent],
    control: eps_control::ControlAddrs,
    secret: &Secret,
    ((mut servers, mut workers), tables): ((u32, u32), bool),
    step: &AtomicU64,
    spawn: &Sender<Spawn>,
    out: &Mutex<ScaleOutcome>,
) -> Result<(), String> {
    let mut ctl = ControlClient::connect(control, secret, Duration::from_secs(30)).map_err(|e| e.to_string())?;
    for ev in plan {
        while step.load(Ordering::Acquire) < ev.step {
            std::thread::sleep(Duration::from_millis(2));
        }
        let msg = match ev.target {
            Target::Servers(n) => ControlMsg::Scale { servers: n },
            Target::Workers(n) => ControlMsg::ScaleWorkers { workers: n },
        };
        // Retry while the job starts or an earlier event is still under way.
        let deadline = Instant::now() + Duration::from_secs(120);
        ctl.call_when_possible(&msg, deadline).map_err(|e| format!("scale event at step {} ({:?}): {e}", ev.step, ev.target))?;
        let now = step.load(Ordering::Acquire);
        let (mut min_done, mut min_buckets) = {
            let o = out.lock().unwrap_or_else(|p| p.into_inner());
            (o.moves(), o.bucket_moves)
        };
        match ev.target {
            Target::Servers(n) => {
                eps_proto::say_event!(
                    "scale",
                    { step = now, servers_from = servers, servers_to = n },
                    "eps train: step {now}: scaling servers {servers} -> {n}"
                );
                if n > servers {
                    let _ = spawn.send(Spawn::Servers(n - servers));
                }
                min_done += u64::from(n != servers);
                min_buckets += u64::from(n != servers && tables);
                servers = n;
            }
            Target::Workers(n) => {
                eps_proto::say_event!(
                    "scale",
                    { step = now, workers_from = workers, workers_to = n },
                    "eps train: step {now}: scaling workers {workers} -> {n} at the next iteration boundary"
                );
                if n > workers {
                    let _ = spawn.send(Spawn::Workers(n - workers));
                }
                workers = n;
            }
        }
        out.lock().unwrap_or_else(|p| p.into_inner()).events += 1;
        wait_settled(&mut ctl, out, (min_done, min_buckets));
    }
    Ok(())
}

/// Follows `eps status` until no migration, split or bucket move is in flight, no server
/// is joining, no worker change or bucket move is being voted on or waits for its workers
/// to register, and at least `min_done` moves (migrations and bucket moves), of them
/// `min_buckets` bucket moves, are done (or the job ended), recording the numbers done.
/// (A change of servers moves buckets only once its vote has begun: until then
/// nothing says a move is coming.)
pub fn wait_settled(ctl: &mut ControlClient, out: &Mutex<ScaleOutcome>, (min_done, min_buckets): (u64, u64)) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        // The status's fields (`eps status --json`), not its words.
        let Ok(ControlMsg::StatusReport { text }) = ctl.call(&ControlMsg::StatusJson) else { return };
        let Ok(st) = serde_json::from_str::<serde_json::Value>(&text) else { return };
        let n = |k: &str| st.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        let yes = |k: &str| st.get(k).and_then(serde_json::Value::as_bool).unwrap_or(false);
        let (done, buckets) = (n("migrations_done"), n("bucket_moves_done"));
        {
            let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
            (o.migrations, o.splits, o.bucket_moves) = (done, n("splits"), buckets);
        }
        let busy = n("migrations_in_flight") > 0
            || yes("splitting")
            || n("servers_joining") > 0
            || yes("worker_change")
            || yes("buckets_moving");
        if !busy && done + buckets >= min_done && buckets >= min_buckets {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl ScaleOutcome {
    /// Moves done: shard migrations and bucket moves.
    pub fn moves(&self) -> u64 {
        self.migrations + self.bucket_moves
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_bad_ones_say_why() {
        assert_eq!(
            parse_plan("100:servers=3, 200:workers=4, 300:servers=1").unwrap(),
            vec![
                ScaleEvent { step: 100, target: Target::Servers(3) },
                ScaleEvent { step: 200, target: Target::Workers(4) },
                ScaleEvent { step: 300, target: Target::Servers(1) }
            ]
        );
        assert!(parse_plan("").unwrap().is_empty());
        let p = parse_plan("1:workers=3,2:workers=1,3:servers=4,4:workers=4").unwrap();
        assert_eq!(ranks_needed(&p, 2), 6, "2 initial, 1 joins, then 3 more");
        for (bad, why) in [
            ("x:servers=3", "whole number"),
            ("100servers=3", "no ':'"),
            ("100:servers=0", "at least one server"),
            ("100:workers=0", "at least one worker"),
            ("100:gpus=2", "unknown resource"),
            ("300:servers=2,100:servers=3", "ascending"),
        ] {
            let e = parse_plan(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
