//! Standard base64 (with padding), as etcd's JSON gateway writes bytes.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Encodes `b`.
pub fn encode(b: &[u8]) -> String {
    let mut out = String::with_capacity(b.len().div_ceil(3) * 4);
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes `s`; `None` if it is not base64.
pub fn decode(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &ch in s {
        let v = ALPHABET.iter().position(|&a| a == ch)? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trips_and_matches_known_values() {
        assert_eq!(super::encode(b"foo"), "Zm9v");
        assert_eq!(super::encode(b"fo"), "Zm8=");
        assert_eq!(super::encode(b"f"), "Zg==");
        assert_eq!(super::encode(b""), "");
        assert_eq!(super::decode("YmFy").unwrap(), b"bar");
        assert_eq!(super::decode("Zm8=").unwrap(), b"fo");
        assert!(super::decode("a*b").is_none());
        let all: Vec<u8> = (0..=255u8).collect();
        for n in 0..all.len() {
            assert_eq!(super::decode(&super::encode(&all[..n])).unwrap(), &all[..n]);
        }
    }
}
