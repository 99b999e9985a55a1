//! Tests of the shards' memory: limits, updates beside and in place, splits.

use super::*;

#[test]
fn too_much_memory_is_a_clear_error() {
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let opt = Optimizer::Sgd { weight_decay: 0.0 };
    let mut m = ShardMemory::new(&pd, DType::F32, 2, &opt, 1, None);
    let e = m.add(0, 0, 1 << 40, Origin::Init(&|_| 0.0)).unwrap_err();
    let msg = format!("{e}: {}", std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default());
    assert!(msg.contains("published parameters") && msg.contains("879609"), "says how much: {msg}");
    assert!(msg.contains("shard 0"), "says which shard: {msg}");
}

/// The parts of a split hold exactly the parent's master values, optimizer
/// state and published bits of their ranges.
#[test]
fn a_split_copies_each_part_of_the_parent() {
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let opt = Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false };
    for dtype in [DType::F32, DType::Bf16] {
        let mut m = ShardMemory::new(&pd, dtype, 2, &opt, 1, None);
        let (start, len, lo_len) = (4096u64, 5000u64, 2048u64);
        m.add(0, start, len, Origin::Init(&|i| (i as f32).sin() * 3.0)).unwrap();
        {
            let b = m.block_mut(0).unwrap();
            let all: &mut [f32] = bytemuck::cast_slice_mut(b.state.view_mut().unwrap());
            for (i, x) in all[len as usize..len as usize * 3].iter_mut().enumerate() {
                *x = i as f32 * 0.5;
            }
        }
        m.publish(0, 1).unwrap();
        m.set_stamp(0, 1, 7);
        m.split(0, 1, 7, [(3, lo_len), (4, len - lo_len)]).unwrap();
        let es = dtype.size_bytes();
        let p = m.get(0).unwrap();
        let (pst, ppub) = (p.state.view().unwrap().to_vec(), p.published.view().unwrap().to_vec());
        let pst: &[f32] = bytemuck::cast_slice(&pst);
        let poff = published_offset(p.bytes as u64, 1) as usize;
        for (id, off, n) in [(3u32, 0usize, lo_len as usize), (4, lo_len as usize, (len - lo_len) as usize)] {
            let c = m.get(id).unwrap();
            assert_eq!((c.start, c.len), (start + off as u64, n as u64));
            let (cst, cpub) = (c.state.view().unwrap(), c.published.view().unwrap());
            let cst: &[f32] = bytemuck::cast_slice(cst);
            assert_eq!(&cst[..n], &pst[off..off + n], "master of {id}");
            assert_eq!(&cst[n..3 * n], &pst[len as usize + 2 * off..len as usize + 2 * (off + n)], "state of {id}");
            let coff = published_offset(c.bytes as u64, 1) as usize;
            assert_eq!(&cpub[coff..coff + n * es], &ppub[poff + off * es..poff + (off + n) * es], "published {id}");
            assert_eq!(&cpub[8..16], &7u64.to_le_bytes(), "stamp of buffer 1");
            assert_eq!(&cpub[..8], &STAMP_WRITING.to_le_bytes(), "stamp of buffer 0");
        }
    }
}

/// With a device holding the master copies and state (and, direct, using the
/// landing slots and published copies in place), updates, forwarded updates,
/// a forward filled from a slot, a carried-over version, stamps, publishing
/// and splits give the host path's bits, and `to_host` brings the host region
/// back to the device's values.
#[test]
fn the_device_path_equals_the_host_path() {
    let pd = SoftDevice::open().unwrap().alloc_pd();
    let opt = Optimizer::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, decoupled: true };
    let agg = eps_agg::CpuAggregator::new(1);
    for dtype in [DType::F32, DType::F16] {
        let es = dtype.size_bytes();
        let (len, lo) = (40_000u64, 16_384u64);
        let host = || Some(Arc::new(eps_agg::HostDevice) as Arc<dyn ShardDevice>);
        let mut mems: Vec<ShardMemory<_>> =
            [None, host(), host()].into_iter().map(|d| ShardMemory::new(&pd, dtype, 3, &opt, 1, d)).collect();
        let direct = mems.pop().unwrap().with_direct(Arc::new(HostRegions));
        assert!(direct.is_direct());
        mems.push(direct);
        let mut published = Vec::new();
        for m in &mut mems {
            m.add(0, 0, len, Origin::Init(&|i| (i as f32 * 0.01).cos())).unwrap();
            m.publish(0, 0).unwrap();
            for step in 0..3u64 {
                let b = m.block_mut(0).unwrap();
                for (r, slot) in b.landing.iter_mut().enumerate() {
                    let v: Vec<f32> = (0..len).map(|i| ((i + step * 7 + r as u64) as f32 * 0.37).sin()).collect();
                    let mut bytes = vec![0u8; len as usize * es];
                    eps_agg::reduce::narrow(dtype, &v, &mut bytes);
                    slot.write_at(0, &bytes);
                }
                // From step 1 on, contributions 0 and 2 are staged as they land.
                if step > 0 {
                    m.stage(0, 0).unwrap();
                    m.stage(0, 2).unwrap();
                }
                let u = UpdateArgs { agg: &agg, opt: &opt, scalars: opt.scalars(step, 0.01), scale: 1.0 / 3.0, threads: 1 };
                m.update(0, (step % 2) as usize, &[0, 1, 2], &u).unwrap();
                // An averaged tensor's elements in the shard.
                m.average_ranges(0, (step % 2) as usize, &[0, 1, 2], &[(5, 40)]).unwrap();
            }
            // A forwarded update: through the migration gradient buffer.
            m.add_forward_buffer(0).unwrap();
            let g: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).sin() * 1e-2).collect();
            m.block_mut(0).unwrap().grad.as_mut().unwrap().write_at(0, bytemuck::cast_slice(&g));
            let u = UpdateArgs { agg: &agg, opt: &opt, scalars: opt.scalars(3, 0.01), scale: 1.0, threads: 1 };
            m.apply_forwarded(0, 1, &u).unwrap();
            m.average_forwarded(0, 1, &[(5, 40)]).unwrap();
            m.set_stamp(0, 1, 4);
            // A forward filled from slot 1, and version 4 carried over into
            // buffer 0.
            m.fill_forward(0, 1, 0.5, &[(3, 10)]);
            let mut fwd = vec![0u8; len as usize * 4];
            m.get(0).unwrap().grad.as_ref().unwrap().read_at(0, &mut fwd);
            m.carry(0, 0);
            m.set_stamp(0, 0, 5);
            m.split(0, 1, 4, [(1, lo), (2, len - lo)]).unwrap();
            let mut mine = Vec::new();
            for id in [0u32, 1, 2] {
                m.to_host(id).unwrap();
                let b = m.get(id).unwrap();
                let mut all = vec![0u8; b.published.len()];
                b.published.read_at(0, &mut all);
                let mut st = vec![0u8; b.len as usize * 3 * 4];
                b.state.read_at(0, &mut st);
                mine.push((all, st));
            }
            mine.push((fwd, Vec::new()));
            published.push(mine);
        }
        assert!(
            published[1].iter().flat_map(|(_, st)| st.chunks(4)).all(|x| !f32::from_le_bytes(x.try_into().unwrap()).is_nan())
        );
        assert_eq!(published[0], published[1], "{dtype:?}: the device path differs");
        assert_eq!(published[0], published[2], "{dtype:?}: the direct path differs");
    }
}
