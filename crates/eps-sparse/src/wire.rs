//! What a worker WRITEs into a server's sparse landing regions, and how a
//! server reads it without trusting it.
//!
//! A request is a 40-byte header, the keys (u64), then for a push the
//! gradient rows (`dim` values each, in the keys' order, in the table's
//! dtype: f32, bf16 or f16): little-endian, as
//! the fabric's registered memory holds them. A pull names the address and
//! rkey in the worker's row buffer the answer goes to; the server WRITEs the rows there in
//! the order asked, which its rkey lets it reach alone. Every field is checked against the table and the region
//! before anything is read or changed.

use crate::decl::Declared;

/// Bytes of a request's header.
pub const HEADER: usize = 40;
/// The header's first word.
pub const MAGIC: u32 = u32::from_le_bytes(*b"EPSS");

/// A request's operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Keys and their gradient rows, for iteration `seq`.
    Push = 1,
    /// Keys whose rows the worker wants at version `seq` or later.
    Pull = 2,
}

/// A request's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The table's index in the spec.
    pub table: u16,
    /// What it asks.
    pub op: Op,
    /// Keys that follow.
    pub count: u32,
    /// Values per row (the worker's idea of the table's).
    pub dim: u32,
    /// Push: the iteration; pull: the version wanted.
    pub seq: u64,
    /// Pull: where the rows go (the worker's registered row buffer).
    pub reply_addr: u64,
    /// Pull: that buffer's rkey.
    pub reply_rkey: u32,
}

/// The reply address of a pull that is not answered: only its bookkeeping
/// (rows created, rows touched) is taken. A worker sends one to a stand-in
/// for the last pull a lost server answered, whose bookkeeping the
/// stand-in's copy lacks.
pub const NO_REPLY: u64 = u64::MAX;

/// Why a request is refused (the worker broke the protocol or its caller
/// passed bad input: nothing was changed).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// Not a request header.
    #[error("not a sparse request (bad header)")]
    Header,
    /// A request for another table or operation than the region is for.
    #[error("a {got:?} request for table {table} landed in the region of a {want:?} of table {region}")]
    Misplaced {
        /// What it asked.
        got: Op,
        /// Its table.
        table: u16,
        /// What the region takes.
        want: Op,
        /// The region's table.
        region: u16,
    },
    /// A row dimension that is not the table's.
    #[error("rows of dimension {got} for table {table:?} of dimension {want}")]
    Dim {
        /// The table.
        table: String,
        /// What came.
        got: u32,
        /// The table's.
        want: usize,
    },
    /// More keys than one request may carry.
    #[error("{count} keys in one request to one server; table {table:?} takes at most {max} (its max_keys)")]
    TooManyKeys {
        /// The table.
        table: String,
        /// What came.
        count: u32,
        /// The limit.
        max: usize,
    },
    /// Fewer or more bytes than the header says.
    #[error("{got} bytes for a request of {want}")]
    Length {
        /// What landed.
        got: usize,
        /// What the header implies.
        want: usize,
    },
    /// A key outside the table's declared range.
    #[error("key {key} of table {table:?} is not below its key_limit {limit}")]
    KeyRange {
        /// The table.
        table: String,
        /// The key.
        key: u64,
        /// The limit.
        limit: u64,
    },
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&self.table.to_le_bytes());
        b[6] = self.op as u8;
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b[12..16].copy_from_slice(&self.dim.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.reply_addr.to_le_bytes());
        b[32..36].copy_from_slice(&self.reply_rkey.to_le_bytes());
        b
    }

    /// Reads a header, or `None` if these are not one's bytes.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b: &[u8; HEADER] = b.get(..HEADER)?.try_into().ok()?;
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC || b[7] != 0 || u32_at(36) != 0 {
            return None;
        }
        let op = match b[6] {
            1 => Op::Push,
            2 => Op::Pull,
            _ => return None,
        };
        Some(Self {
            table: u16::from_le_bytes([b[4], b[5]]),
            op,
            count: u32_at(8),
            dim: u32_at(12),
            seq: u64_at(16),
            reply_addr: u64_at(24),
            reply_rkey: u32_at(32),
        })
    }

    /// Bytes of the whole request, for values of `elem` bytes.
    pub fn bytes(&self, elem: usize) -> usize {
        request_bytes(self.op, self.count as usize, self.dim as usize, elem)
    }
}

/// Bytes of a request of `count` keys of dimension `dim`, values of `elem`
/// bytes.
pub fn request_bytes(op: Op, count: usize, dim: usize, elem: usize) -> usize {
    HEADER + count * 8 + if op == Op::Push { count * dim * elem } else { 0 }
}

/// Bytes of the landing region of one worker's `op` requests for table `t`.
pub fn region_bytes(op: Op, t: &Declared) -> usize {
    request_bytes(op, t.max_keys, t.spec.dim, t.elem())
}

/// `rows` (values in `dtype`) as f32: in place for f32, else widened into
/// `scratch`.
pub fn widen<'a>(dtype: eps_agg::DType, rows: &'a [u8], scratch: &'a mut Vec<f32>) -> &'a [f32] {
    if dtype == eps_agg::DType::F32 {
        // (Rows follow the 8-byte keys in an 8-byte aligned region.)
        if let Ok(v) = bytemuck::try_cast_slice(rows) {
            return v;
        }
    }
    scratch.clear();
    scratch.resize(rows.len() / dtype.size_bytes(), 0.0);
    eps_agg::reduce::sum_serial(dtype, &[rows], scratch);
    scratch
}

/// The largest request or answer of `spec`'s tables (what the fabric's
/// message limit must admit).
pub fn max_message_bytes(spec: &eps_proto::JobSpec) -> u64 {
    let one = |t: &Declared| region_bytes(Op::Push, t).max(t.max_keys * t.spec.dim * 4) as u64;
    crate::decl::tables(spec).iter().map(one).max().unwrap_or(0)
}

/// A checked request, its keys and rows read in place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request<'a> {
    /// Its header.
    pub header: Header,
    /// The keys.
    pub keys: &'a [u64],
    /// Push: the gradient rows (`keys.len() * dim` values in the table's
    /// dtype; see [`widen`]); pull: empty.
    pub rows: &'a [u8],
}

/// Reads the request of `len` bytes that landed in `region` (the landing
/// region of `want` requests for table `t`), checking every field.
/// `region` must be 8-byte aligned (registered memory is page-aligned).
pub fn parse<'a>(region: &'a [u8], len: usize, want: Op, t: &Declared) -> Result<Request<'a>, WireError> {
    let h = Header::decode(region).ok_or(WireError::Header)?;
    if h.op != want || h.table != t.index {
        return Err(WireError::Misplaced { got: h.op, table: h.table, want, region: t.index });
    }
    if h.dim as usize != t.spec.dim {
        return Err(WireError::Dim { table: t.name.clone(), got: h.dim, want: t.spec.dim });
    }
    if h.count as usize > t.max_keys {
        return Err(WireError::TooManyKeys { table: t.name.clone(), count: h.count, max: t.max_keys });
    }
    let n = h.count as usize;
    let want_len = h.bytes(t.elem());
    if len != want_len || region.len() < len {
        return Err(WireError::Length { got: len, want: want_len });
    }
    let keys: &[u64] = bytemuck::try_cast_slice(&region[HEADER..HEADER + n * 8]).map_err(|_| WireError::Header)?;
    let rows = &region[HEADER + n * 8..len];
    if let (Some(limit), Some(&key)) = (t.key_limit, keys.iter().find(|k| !t.admits(**k))) {
        return Err(WireError::KeyRange { table: t.name.clone(), key, limit });
    }
    Ok(Request { header: h, keys, rows })
}

/// Writes a request into `out` (at least [`request_bytes`] long): the
/// header, the keys, and for a push the rows (an f32 table's). Returns its
/// length.
pub fn write(out: &mut [u8], h: &Header, keys: &[u64], rows: &[f32]) -> usize {
    let n = keys.len();
    debug_assert_eq!(h.count as usize, n);
    out[..HEADER].copy_from_slice(&h.encode());
    out[HEADER..HEADER + n * 8].copy_from_slice(bytemuck::cast_slice(keys));
    let end = HEADER + n * 8 + rows.len() * 4;
    out[HEADER + n * 8..end].copy_from_slice(bytemuck::cast_slice(rows));
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Init, RowOptimizer, TableSpec};

    fn table() -> Declared {
        Declared {
            name: "ids".into(),
            index: 3,
            spec: TableSpec {
                dim: 2,
                opt: RowOptimizer::Dense(eps_agg::Optimizer::Sgd { weight_decay: 0.0 }),
                init: Init::Zeros,
                seed: 0,
                max_rows: 100,
            },
            lr: 0.1,
            key_limit: Some(1000),
            evict: None,
            max_keys: 4,
            dtype: eps_agg::DType::F32,
        }
    }

    /// An 8-byte aligned region.
    fn region(t: &Declared, op: Op) -> Vec<u64> {
        vec![0u64; region_bytes(op, t).div_ceil(8)]
    }

    #[test]
    fn a_request_reads_back_in_place() {
        let t = table();
        let mut r = region(&t, Op::Push);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut r);
        let h = Header { table: 3, op: Op::Push, count: 2, dim: 2, seq: 1 << 40, reply_addr: 0, reply_rkey: 0 };
        let n = write(bytes, &h, &[7, 999], &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(n, request_bytes(Op::Push, 2, 2, 4));
        let q = parse(bytes, n, Op::Push, &t).unwrap();
        let rows: &[f32] = bytemuck::cast_slice(q.rows);
        assert_eq!((q.header, q.keys, rows), (h, &[7u64, 999][..], &[1.0f32, 2.0, 3.0, 4.0][..]));
        let mut p = region(&t, Op::Pull);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut p);
        let h = Header { op: Op::Pull, count: 1, reply_addr: 64, reply_rkey: 9, ..h };
        let n = write(bytes, &h, &[5], &[]);
        let q = parse(bytes, n, Op::Pull, &t).unwrap();
        assert_eq!((q.keys, q.rows.len(), q.header.reply_addr, q.header.reply_rkey), (&[5u64][..], 0, 64, 9));
    }

    #[test]
    fn every_bad_field_is_refused() {
        let t = table();
        let mut r = region(&t, Op::Push);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut r);
        let good = Header { table: 3, op: Op::Push, count: 1, dim: 2, seq: 0, reply_addr: 0, reply_rkey: 0 };
        let cases: [(Header, Vec<u64>, WireError); 5] = [
            (Header { dim: 3, ..good }, vec![1], WireError::Dim { table: "ids".into(), got: 3, want: 2 }),
            (Header { table: 2, ..good }, vec![1], WireError::Misplaced { got: Op::Push, table: 2, want: Op::Push, region: 3 }),
            (
                Header { op: Op::Pull, ..good },
                vec![1],
                WireError::Misplaced { got: Op::Pull, table: 3, want: Op::Push, region: 3 },
            ),
            (Header { count: 5, ..good }, vec![1; 5], WireError::TooManyKeys { table: "ids".into(), count: 5, max: 4 }),
            (good, vec![1000], WireError::KeyRange { table: "ids".into(), key: 1000, limit: 1000 }),
        ];
        for (h, keys, want) in cases {
            let rows = vec![0.5f32; keys.len() * h.dim as usize];
            bytes.fill(0);
            let n = HEADER + keys.len() * 8 + rows.len() * 4;
            if n <= bytes.len() {
                write(bytes, &h, &keys, &rows);
            } else {
                bytes[..HEADER].copy_from_slice(&h.encode());
            }
            assert_eq!(parse(bytes, n.min(bytes.len()), Op::Push, &t).unwrap_err(), want, "{h:?}");
        }
        let n = write(bytes, &good, &[1], &[0.0, 0.0]);
        assert_eq!(parse(bytes, n - 4, Op::Push, &t).unwrap_err(), WireError::Length { got: n - 4, want: n });
        bytes[0] ^= 1;
        assert_eq!(parse(bytes, n, Op::Push, &t).unwrap_err(), WireError::Header);
        assert_eq!(parse(&bytes[..8], 8, Op::Push, &t).unwrap_err(), WireError::Header);
    }
}
