//! Health at a glance for `eps status`: each role up, lagging or gone (from
//! its lease: a worker's last call, a server's last order poll), the job's
//! iteration rate, and the same as one JSON object for `eps status --json`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::State;

/// How far back the iteration rate looks.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// The furthest iteration over the last few seconds.
#[derive(Debug, Default)]
pub(super) struct Rate(VecDeque<(Instant, u64)>);

impl Rate {
    pub fn sample(&mut self, now: Instant, iteration: u64) {
        self.0.push_back((now, iteration));
        while self.0.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
            self.0.pop_front();
        }
    }

    /// Iterations per second, once it has a second of samples.
    pub fn per_second(&self) -> Option<f64> {
        let (&(t0, i0), &(t1, i1)) = (self.0.front()?, self.0.back()?);
        let dt = t1.duration_since(t0).as_secs_f64();
        (dt >= 1.0).then(|| i1.saturating_sub(i0) as f64 / dt)
    }
}

/// A role's health from the age of its last sign of life and its lease:
/// up within half the lease, lagging within it, missing past it.
fn by_age(age: Duration, lease: Duration) -> &'static str {
    if age <= lease / 2 {
        "up"
    } else if age <= lease {
        "lagging"
    } else {
        "missing"
    }
}

/// A role that lags or is missing goes into `problems`: `who health:
/// what N s ago`.
fn note(problems: &mut Vec<String>, who: &str, health: &str, age: Option<Duration>, what: &str) {
    if matches!(health, "lagging" | "missing") {
        let a = age.unwrap_or_default().as_secs_f64();
        problems.push(format!("{who} {health}: {what} {a:.1} s ago"));
    }
}

impl State {
    /// The job's state and health as one JSON object.
    pub(super) fn status_json(&self) -> Value {
        let now = Instant::now();
        let f = self.job.figures();
        let mut problems: Vec<String> = Vec::new();
        let workers: Vec<Value> = self
            .job
            .worker_rows()
            .iter()
            .map(|w| {
                let age = self.seen.get(&w.rank).map(|t| now.saturating_duration_since(*t));
                let health = match (w.state, age) {
                    ("contributing", Some(a)) => by_age(a, self.lease),
                    ("contributing", None) => "up",
                    _ => "-",
                };
                note(&mut problems, &format!("worker {}", w.rank), health, age, "last heard of");
                json!({"rank": w.rank, "state": w.state, "health": health, "iteration": w.iteration,
                       "lease_age_ms": age.map(|a| a.as_millis() as u64)})
            })
            .collect();
        let servers: Vec<Value> = self
            .job
            .server_rows()
            .iter()
            .map(|s| {
                // Its order poll is answered at `deadline`: alive until then.
                let age = self.polled.get(&s.rank).map(|t| now.saturating_duration_since(*t));
                let health = match (s.state, age) {
                    ("serving" | "leaving", Some(a)) => by_age(a, self.server_lease),
                    ("serving" | "leaving" | "joining", _) => "up",
                    _ => "-",
                };
                note(&mut problems, &format!("server {}", s.rank), health, age, "last order poll");
                if s.state == "lost" && s.shards > 0 {
                    problems.push(format!("server {} lost, {} shards with it", s.rank, s.shards));
                }
                json!({"rank": s.rank, "state": s.state, "health": health, "addr": s.addr, "shards": s.shards,
                       "bytes": s.bytes, "poll_age_ms": age.map(|a| a.as_millis() as u64)})
            })
            .collect();
        json!({
            "job": self.name,
            "healthy": problems.is_empty(),
            "problems": problems,
            "leader": {"addr": self.addr.to_string(), "pid": std::process::id()},
            "epoch": f.epoch,
            "iteration": f.iteration,
            "slowest_iteration": f.slowest,
            "iterations_per_s": self.rate.per_second(),
            "membership_changes": f.membership_changes,
            "migrations_in_flight": f.migrations_in_flight,
            "migrations_done": f.migrations_done,
            "splits": f.splits,
            "splitting": f.splitting,
            "servers_joining": f.servers[1],
            "worker_change": f.worker_change,
            "bucket_moves_done": f.bucket_moves,
            "buckets_moving": f.buckets_moving,
            "shards": f.shards,
            "shards_protected": f.protected,
            "row_holders": f.row_holders,
            "row_holders_protected": f.row_holders_protected,
            "rows_standing_in": f.rows_standing_in,
            "parameter_bytes": f.bytes,
            "moves": self.job.move_rows().iter().map(|m| json!({"shard": m.shard, "from": m.from, "to": m.to, "phase": m.phase,
                "at": m.at, "bytes": m.bytes, "millis": m.millis})).collect::<Vec<_>>(),
            "checkpoint": self.last_checkpoint.as_ref().map(|(v, p)| json!({"iteration": v, "dir": p.display().to_string()})),
            "workers": workers,
            "servers": servers,
        })
    }

    /// The lines `eps status` starts with: health and rate.
    pub(super) fn health_text(&self) -> String {
        let j = self.status_json();
        let rate = self.rate.per_second().map_or("-".to_string(), |r| format!("{r:.1}"));
        let mut t = match j["problems"].as_array() {
            Some(p) if !p.is_empty() => {
                let list: Vec<&str> = p.iter().filter_map(Value::as_str).collect();
                format!("health: {}", list.join("; "))
            }
            _ => "health: ok".to_string(),
        };
        t += &format!(" ({rate} iterations/s; control plane pid {} on {})", std::process::id(), self.addr);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_follows_the_lease_and_the_rate_its_window() {
        let l = Duration::from_secs(10);
        assert_eq!(by_age(Duration::from_secs(2), l), "up");
        assert_eq!(by_age(Duration::from_secs(7), l), "lagging");
        assert_eq!(by_age(Duration::from_secs(11), l), "missing");
        let mut r = Rate::default();
        let t = Instant::now();
        r.sample(t, 10);
        assert_eq!(r.per_second(), None);
        r.sample(t + Duration::from_secs(2), 30);
        assert_eq!(r.per_second(), Some(10.0));
        r.sample(t + Duration::from_secs(6), 90);
        // The first sample fell out of the window: (90 - 30) over 4 s.
        assert_eq!(r.per_second(), Some(15.0));
    }
}
