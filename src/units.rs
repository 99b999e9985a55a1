//! Human-readable sizes: `64`, `4KiB`, `4MiB`, `1GiB` (binary), `4K`/`4M`/`4G`
//! (binary too, like perftest), `4kB`/`4MB`/`4GB` (decimal).

/// Why a size string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason} (examples: 64, 4KiB, 4MiB, 1GiB)")]
pub struct SizeError {
    input: String,
    reason: &'static str,
}

/// Parses a size with an optional unit suffix.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError { input: s.to_string(), reason };
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(err("it does not start with a number"));
    }
    let n: u64 = num.parse().map_err(|_| err("the number is too large"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" | "k" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err(err("unknown unit")),
    };
    n.checked_mul(mult).ok_or_else(|| err("the size overflows 64 bits"))
}

/// Parses a count with an optional decimal suffix: `65536`, `64K` (64,000),
/// `100M`, `2G`.
pub fn parse_count(s: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError { input: s.to_string(), reason };
    let t = s.trim();
    let (num, mult) = match t.strip_suffix(['K', 'k']) {
        Some(n) => (n, 1_000),
        None => match t.strip_suffix('M') {
            Some(n) => (n, 1_000_000),
            None => t.strip_suffix('G').map_or((t, 1), |n| (n, 1_000_000_000)),
        },
    };
    let n: u64 = num.trim().parse().map_err(|_| err("not a count (examples: 65536, 64K, 100M)"))?;
    n.checked_mul(mult).ok_or_else(|| err("the count overflows 64 bits"))
}

/// Formats bytes with a binary unit, e.g. `4 MiB`.
pub fn format_size(n: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, m) in UNITS {
        if n >= m && n % m == 0 {
            return format!("{} {u}", n / m);
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64"), Ok(64));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("4kB"), Ok(4000));
        assert!(parse_size("").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("4XB").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("20000000000G").is_err());
        assert_eq!(format_size(4 << 20), "4 MiB");
        assert_eq!(format_size(100), "100 B");
        assert_eq!(parse_count("100M"), Ok(100_000_000));
        assert_eq!(parse_count("64K"), Ok(64_000));
        assert_eq!(parse_count("65536"), Ok(65536));
        assert!(parse_count("1.5M").is_err() && parse_count("M").is_err() && parse_count("99999999999G").is_err());
    }
}
