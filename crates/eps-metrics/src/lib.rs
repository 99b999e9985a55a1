//! Metrics of an EPS process: counters, gauges and latency histograms kept in
//! one registry per process (a process may host several roles: a job on
//! threads; labels tell them apart), written in the Prometheus text format,
//! and served with a health check over HTTP (`serve`).
//!
//! Updating a counter or gauge is one relaxed atomic operation; a histogram
//! records under a mutex of its own (once per push_pull, not per byte).

#![forbid(unsafe_code)]

mod http;
pub mod log;
mod text;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

pub use http::{Endpoint, Health, serve};

/// A value that only grows.
#[derive(Clone, Debug, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    /// Adds 1.
    pub fn inc(&self) {
        self.add(1);
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (an f64).
#[derive(Clone, Debug)]
pub struct Gauge(Arc<AtomicU64>);

impl Default for Gauge {
    fn default() -> Self {
        Gauge(Arc::new(AtomicU64::new(0f64.to_bits())))
    }
}

impl Gauge {
    /// Sets it.
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }

    /// The value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// Durations, recorded in microseconds (1 us to 1 hour, 3 significant
/// digits), exported as a Prometheus histogram in seconds.
#[derive(Clone, Debug)]
pub struct Histogram(Arc<Mutex<hdrhistogram::Histogram<u64>>>);

impl Default for Histogram {
    fn default() -> Self {
        let h = hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds");
        Histogram(Arc::new(Mutex::new(h)))
    }
}

impl Histogram {
    /// Records one duration.
    pub fn observe(&self, d: std::time::Duration) {
        let us = (d.as_micros() as u64).clamp(1, 3_600_000_000);
        self.0.lock().unwrap_or_else(|p| p.into_inner()).saturating_record(us);
    }

    /// (count, sum in seconds, cumulative counts at each of `BUCKETS_S`).
    pub fn snapshot(&self) -> (u64, f64, Vec<u64>) {
        let h = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let sum_us: f64 = h.iter_recorded().map(|v| v.value_iterated_to() as f64 * v.count_at_value() as f64).sum();
        let buckets = BUCKETS_S.iter().map(|&le| h.count_between(0, (le * 1e6) as u64)).collect();
        (h.len(), sum_us / 1e6, buckets)
    }
}

/// The histograms' bucket bounds in seconds (`le`): 50 us to 10 s.
pub const BUCKETS_S: [f64; 16] =
    [5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// What a series holds.
#[derive(Clone, Debug)]
enum Value {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

/// One labelled series of a family.
#[derive(Clone, Debug)]
struct Series {
    labels: Vec<(String, String)>,
    value: Value,
}

/// A metric name with its help text and its series.
#[derive(Clone, Debug)]
struct Family {
    name: String,
    help: String,
    kind: &'static str,
    series: Vec<Series>,
}

/// A gauge read when scraped (process RSS, a state's size): name, help,
/// labels and how to read it.
struct Probe {
    name: String,
    help: String,
    kind: &'static str,
    labels: Vec<(String, String)>,
    read: Box<dyn Fn() -> f64 + Send + Sync>,
}

/// The metrics of a process.
#[derive(Default)]
pub struct Registry {
    families: Mutex<Vec<Family>>,
    probes: Mutex<Vec<Probe>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").finish_non_exhaustive()
    }
}

/// The process's registry.
pub fn global() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| {
        let r = Registry::default();
        r.probe("eps_process_resident_memory_bytes", "Resident memory of the process.", &[], || {
            resident_bytes().map_or(f64::NAN, |b| b as f64)
        });
        r
    })
}

/// Labels as `(name, value)` pairs.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

impl Registry {
    fn get(&self, name: &str, help: &str, kind: &'static str, labels: Labels<'_>, make: impl FnOnce() -> Value) -> Value {
        debug_assert!(text::valid_name(name), "metric name {name}");
        let labels: Vec<(String, String)> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut fams = self.families.lock().unwrap_or_else(|p| p.into_inner());
        let fam = match fams.iter().position(|f| f.name == name) {
            Some(i) => &mut fams[i],
            None => {
                fams.push(Family { name: name.into(), help: help.into(), kind, series: Vec::new() });
                fams.last_mut().expect("pushed")
            }
        };
        // The same name and labels give the same series (a role started
        // twice in one process counts on).
        if let Some(s) = fam.series.iter().find(|s| s.labels == labels) {
            return s.value.clone();
        }
        let value = make();
        fam.series.push(Series { labels, value: value.clone() });
        value
    }

    /// The counter `name` with `labels` (created at 0 the first time).
    pub fn counter(&self, name: &str, help: &str, labels: Labels<'_>) -> Counter {
        match self.get(name, help, "counter", labels, || Value::Counter(Counter::default())) {
            Value::Counter(c) => c,
            _ => panic!("{name} is registered as another kind"),
        }
    }

    /// The gauge `name` with `labels`.
    pub fn gauge(&self, name: &str, help: &str, labels: Labels<'_>) -> Gauge {
        match self.get(name, help, "gauge", labels, || Value::Gauge(Gauge::default())) {
            Value::Gauge(g) => g,
            _ => panic!("{name} is registered as another kind"),
        }
    }

    /// The histogram `name` (seconds) with `labels`.
    pub fn histogram(&self, name: &str, help: &str, labels: Labels<'_>) -> Histogram {
        match self.get(name, help, "histogram", labels, || Value::Histogram(Histogram::default())) {
            Value::Histogram(h) => h,
            _ => panic!("{name} is registered as another kind"),
        }
    }

    /// A gauge whose value `f` gives when scraped.
    pub fn probe(&self, name: &str, help: &str, labels: Labels<'_>, f: impl Fn() -> f64 + Send + Sync + 'static) {
        self.add_probe(name, help, "gauge", labels, Box::new(f));
    }

    /// A counter kept elsewhere (a count that only grows), read by `f` when scraped.
    pub fn probe_counter(&self, name: &str, help: &str, labels: Labels<'_>, f: impl Fn() -> f64 + Send + Sync + 'static) {
        self.add_probe(name, help, "counter", labels, Box::new(f));
    }

    fn add_probe(
        &self,
        name: &str,
        help: &str,
        kind: &'static str,
        labels: Labels<'_>,
        read: Box<dyn Fn() -> f64 + Send + Sync>,
    ) {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let p = Probe { name: name.into(), help: help.into(), kind, labels, read };
        self.probes.lock().unwrap_or_else(|p| p.into_inner()).push(p);
    }

    /// Every metric in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let fams = self.families.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut out = String::new();
        for f in &fams {
            text::header(&mut out, &f.name, &f.help, f.kind);
            for s in &f.series {
                match &s.value {
                    Value::Counter(c) => text::sample(&mut out, &f.name, &s.labels, None, c.get() as f64),
                    Value::Gauge(g) => text::sample(&mut out, &f.name, &s.labels, None, g.get()),
                    Value::Histogram(h) => text::histogram(&mut out, &f.name, &s.labels, &h.snapshot()),
                }
            }
        }
        let probes = self.probes.lock().unwrap_or_else(|p| p.into_inner());
        let mut named: Vec<&str> = Vec::new();
        for p in probes.iter() {
            if !named.contains(&p.name.as_str()) {
                text::header(&mut out, &p.name, &p.help, p.kind);
                named.push(&p.name);
            }
            text::sample(&mut out, &p.name, &p.labels, None, (p.read)());
        }
        out
    }
}

/// This process's resident memory (Linux: /proc/self/statm).
pub fn resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// The resident anonymous and shared memory of process `pid` (this one if
/// `None`), from `/proc`: without the file-backed pages of the binary and
/// its libraries, which are shared and most of a small process's `VmRSS`.
pub fn rss_bytes(pid: Option<u32>) -> Option<u64> {
    let path = pid.map_or_else(|| "/proc/self/status".to_string(), |p| format!("/proc/{p}/status"));
    let s = std::fs::read_to_string(path).ok()?;
    let field = |name: &str| -> Option<u64> {
        s.lines().find_map(|l| l.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse().ok())
    };
    Some((field("RssAnon:")? + field("RssShmem:").unwrap_or(0)) * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_registry_renders_every_kind_in_the_text_format() {
        let r = Registry::default();
        let c = r.counter("eps_test_bytes_total", "Bytes.", &[("role", "worker"), ("rank", "0")]);
        c.add(40);
        r.counter("eps_test_bytes_total", "Bytes.", &[("role", "worker"), ("rank", "0")]).add(2);
        r.counter("eps_test_bytes_total", "Bytes.", &[("role", "worker"), ("rank", "1")]).inc();
        r.gauge("eps_test_epoch", "Epoch.", &[]).set(3.0);
        let h = r.histogram("eps_test_seconds", "Latency.", &[("op", "a\"b")]);
        for ms in [1, 2, 30] {
            h.observe(Duration::from_millis(ms));
        }
        r.probe("eps_test_probe", "A probe.", &[], || 7.5);
        let t = r.render();
        assert!(t.contains("# HELP eps_test_bytes_total Bytes.\n# TYPE eps_test_bytes_total counter\n"), "{t}");
        assert!(t.contains("eps_test_bytes_total{role=\"worker\",rank=\"0\"} 42\n"), "{t}");
        assert!(t.contains("eps_test_bytes_total{role=\"worker\",rank=\"1\"} 1\n"), "{t}");
        assert!(t.contains("eps_test_epoch 3\n"), "{t}");
        assert!(t.contains("eps_test_seconds_bucket{op=\"a\\\"b\",le=\"0.001\"} 1\n"), "{t}");
        assert!(t.contains("eps_test_seconds_bucket{op=\"a\\\"b\",le=\"0.0025\"} 2\n"), "{t}");
        assert!(t.contains("eps_test_seconds_bucket{op=\"a\\\"b\",le=\"+Inf\"} 3\n"), "{t}");
        assert!(t.contains("eps_test_seconds_count{op=\"a\\\"b\"} 3\n"), "{t}");
        let sum: f64 = t.lines().find_map(|l| l.strip_prefix("eps_test_seconds_sum{op=\"a\\\"b\"} ")).unwrap().parse().unwrap();
        assert!((sum - 0.033).abs() < 1e-4, "{sum}");
        assert!(t.contains("# TYPE eps_test_probe gauge\neps_test_probe 7.5\n"), "{t}");
        // Every line is a comment or `name{labels} value`.
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let (series, v) = l.rsplit_once(' ').unwrap();
            assert!(v.parse::<f64>().is_ok() || v == "NaN", "{l}");
            assert!(text::valid_name(series.split('{').next().unwrap()), "{l}");
        }
    }

    #[test]
    fn the_process_registry_reports_resident_memory() {
        let t = global().render();
        let rss: f64 = t.lines().find_map(|l| l.strip_prefix("eps_process_resident_memory_bytes ")).unwrap().parse().unwrap();
        assert!(rss > 1e5, "{rss}");
    }
}
