//! The Prometheus text exposition format (version 0.0.4).

use std::fmt::Write;

/// A metric or label name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

/// `# HELP` and `# TYPE` of a family.
pub fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let help = help.replace('\\', "\\\\").replace('\n', "\\n");
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One sample: `name{labels[,extra]} value`.
pub fn sample(out: &mut String, name: &str, labels: &[(String, String)], extra: Option<(&str, &str)>, v: f64) {
    out.push_str(name);
    let all: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).chain(extra).collect();
    if !all.is_empty() {
        out.push('{');
        for (i, (k, v)) in all.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let v = v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
            let _ = write!(out, "{k}=\"{v}\"");
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(&number(v));
    out.push('\n');
}

/// A float as Prometheus writes it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf".into() } else { "-Inf".into() }
    } else {
        format!("{v}")
    }
}

/// A histogram's `_bucket`, `_sum` and `_count` series.
pub fn histogram(out: &mut String, name: &str, labels: &[(String, String)], snap: &(u64, f64, Vec<u64>)) {
    let (count, sum, buckets) = snap;
    let bucket = format!("{name}_bucket");
    for (le, n) in crate::BUCKETS_S.iter().zip(buckets) {
        sample(out, &bucket, labels, Some(("le", &format!("{le}"))), *n as f64);
    }
    sample(out, &bucket, labels, Some(("le", "+Inf")), *count as f64);
    sample(out, &format!("{name}_sum"), labels, None, *sum);
    sample(out, &format!("{name}_count"), labels, None, *count as f64);
}
