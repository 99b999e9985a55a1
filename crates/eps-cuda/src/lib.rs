//! # eps-cuda
//!
//! The GPU side of a parameter server: the kernels of `kernels/eps_kernels.cu`
//! (N-way gradient sums of f32, bf16 or f16 inputs into f32, fused SGD, momentum,
//! Nesterov, Adam and AdamW steps, narrowing to the wire dtype) driven through
//! cudarc, which this crate alone names.
//!
//! cudarc loads the driver at run time, so the same binary runs on hosts without
//! CUDA; it panics if asked for a library that is missing, so every entry point
//! here probes first ([`probe`]) and answers [`CudaError::NoDriver`] instead.
//!
//! The kernels compute what `eps-agg`'s CPU code computes, operation for operation
//! (no fused multiply-adds), so results are meant to be bitwise equal; the tests
//! check them against f64 references and against the CPU.
//!
//! - [`Gpu`]: a device, its stream and the loaded kernels; launches on device spans.
//! - [`CudaDevice`]: shards in GPU memory (`eps_agg::ShardDevice`): master copies
//!   and optimizer state stay there; an update moves only the contributions in and
//!   the published parameters out.
//! - [`CudaAggregator`]: the `eps_agg::Aggregator` seam on a GPU, for host buffers
//!   (each call copies its inputs in and its results out).
//! - `dmabuf` (feature `rdma`): GPU memory registered with an RDMA NIC through its
//!   dmabuf (GPUDirect RDMA).
//! - [`bench`]: GB/s of the kernels against the device-to-device copy rate.
//!
//! # Safety
//! `unsafe` here launches kernels on device pointers whose bounds were checked
//! when their [`Span`] was made, and calls cudarc's library probes.

mod agg;
pub mod bench;
mod device;
#[cfg(feature = "rdma")]
pub mod dmabuf;
#[cfg(test)]
mod host;
mod kernels;

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

pub use agg::CudaAggregator;
pub use device::CudaDevice;
pub use kernels::{ptx_built_in, ptx_for};

/// Why the GPU cannot be used, or what failed on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No NVIDIA driver library (libcuda.so) on this host.
    #[error("no NVIDIA driver: libcuda.so is not installed on this host")]
    NoDriver,
    /// The driver is there but shows no device.
    #[error("the NVIDIA driver shows no GPU")]
    NoDevice,
    /// No PTX was built in and NVRTC cannot compile the kernels.
    #[error(
        "the kernels need compiling and NVRTC (libnvrtc.so) is not installed: install the CUDA toolkit's NVRTC, or build with nvcc on the PATH"
    )]
    NoCompiler,
    /// NVRTC rejected the kernels.
    #[error("compiling the kernels for {arch}: {log}")]
    Compile {
        /// Target architecture.
        arch: &'static str,
        /// NVRTC's log.
        log: String,
    },
    /// A driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// A buffer or range does not fit.
    #[error("{0}")]
    Bounds(String),
}

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
    /// Device memory in bytes.
    pub memory: usize,
    /// Devices the driver shows.
    pub devices: usize,
}

impl std::fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} of {}: {} (sm_{}{}, {} GiB)",
            self.ordinal,
            self.devices,
            self.name,
            self.capability.0,
            self.capability.1,
            self.memory >> 30
        )
    }
}

/// True when the driver library can be loaded (cudarc panics on first use otherwise).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library; no function of it is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// True when NVRTC can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: as above.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Finds the first GPU, or says why there is none. Never panics.
pub fn probe() -> Result<GpuInfo, CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let devices = CudaContext::device_count()?;
    if devices <= 0 {
        return Err(CudaError::NoDevice);
    }
    let ctx = CudaContext::new(0)?;
    Ok(GpuInfo {
        ordinal: 0,
        name: ctx.name()?,
        capability: ctx.compute_capability()?,
        memory: ctx.total_mem()?,
        devices: devices as usize,
    })
}

/// A device with its stream and kernels.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    k: kernels::Kernels,
    info: GpuInfo,
}

/// `len` elements of `T` at a device address, borrowed from the allocation they
/// lie in (bounds checked when made: see [`Gpu::span`]).
#[derive(Clone, Copy, Debug)]
pub struct Span<'a, T> {
    ptr: u64,
    len: usize,
    _of: PhantomData<&'a CudaSlice<T>>,
}

impl<T> Span<'_, T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The device address of the first element.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    /// Whether the address is a multiple of 16 bytes.
    fn aligned16(&self) -> bool {
        self.ptr % 16 == 0
    }
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels (built-in PTX for its
    /// architecture, else compiled by NVRTC).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let devices = CudaContext::device_count()?;
        if devices <= 0 {
            return Err(CudaError::NoDevice);
        }
        if ordinal >= devices as usize {
            return Err(CudaError::Bounds(format!("GPU {ordinal} asked for; the driver shows {devices}")));
        }
        let ctx = CudaContext::new(ordinal)?;
        let info = GpuInfo {
            ordinal,
            name: ctx.name()?,
            capability: ctx.compute_capability()?,
            memory: ctx.total_mem()?,
            devices: devices as usize,
        };
        let stream = ctx.default_stream();
        let k = kernels::Kernels::load(&ctx, info.capability)?;
        Ok(Self { ctx, stream, k, info })
    }

    /// The device.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// The stream every launch and copy here goes on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// `n` zeroed elements in device memory.
    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros::<T>(n.max(1))?)
    }

    /// A device copy of `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies `src` into the device buffer `dst` (from its start).
    pub fn copy_in<T: DeviceRepr>(&self, src: &[T], dst: &mut CudaSlice<T>) -> Result<(), CudaError> {
        if src.len() > dst.len() {
            return Err(CudaError::Bounds(format!("{} elements into a buffer of {}", src.len(), dst.len())));
        }
        let mut view = dst.slice_mut(..src.len());
        Ok(self.stream.memcpy_htod(src, &mut view)?)
    }

    /// Copies the first `out.len()` elements of `src` to the host (and waits).
    pub fn copy_out<T: DeviceRepr>(&self, src: &CudaSlice<T>, out: &mut [T]) -> Result<(), CudaError> {
        if out.len() > src.len() {
            return Err(CudaError::Bounds(format!("{} elements out of a buffer of {}", out.len(), src.len())));
        }
        self.stream.memcpy_dtoh(&src.slice(..out.len()), out)?;
        Ok(self.stream.synchronize()?)
    }

    /// Waits for everything queued on the stream.
    pub fn sync(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// Elements `[offset, offset + len)` of `buf` (any offset: the kernels handle
    /// unaligned spans).
    pub fn span<'a, T>(&self, buf: &'a CudaSlice<T>, offset: usize, len: usize) -> Result<Span<'a, T>, CudaError> {
        if offset.checked_add(len).is_none_or(|e| e > buf.len()) {
            return Err(CudaError::Bounds(format!("elements {offset}..+{len} of a buffer of {}", buf.len())));
        }
        let (base, _sync) = buf.device_ptr(&self.stream);
        Ok(Span { ptr: base + (offset * std::mem::size_of::<T>()) as u64, len, _of: PhantomData })
    }

    /// Bytes `[offset, offset + len)` of `buf` lent to a shard
    /// (`DeviceShard::attach`): the span keeps the buffer allocated.
    pub fn lend(&self, buf: &Arc<CudaSlice<u8>>, offset: usize, len: usize) -> Result<eps_fabric::Span, CudaError> {
        let ptr = self.span(buf, offset, len)?.ptr;
        let owner: Arc<dyn std::any::Any + Send + Sync> = buf.clone();
        // SAFETY: the Arc keeps the device allocation (checked to hold the range
        // above) until the span's last clone goes.
        Ok(unsafe { eps_fabric::Span::new(ptr, len, false, owner) })
    }

    /// `len` elements of `T` at device address `ptr`, memory this crate did not
    /// allocate (attached to a shard by address).
    ///
    /// # Safety
    /// `ptr..ptr + len * size_of::<T>()` is device memory of this context that
    /// stays allocated while the span is used.
    pub(crate) unsafe fn raw_span<T>(&self, ptr: u64, len: usize) -> Span<'static, T> {
        Span { ptr, len, _of: PhantomData }
    }

    /// Makes the NIC's writes into this GPU's memory (GPUDirect RDMA) that
    /// completed before the call visible to work queued after it, on GPUs that
    /// need it (where the device says a flush is supported).
    pub fn flush_rdma_writes(&self) -> Result<(), CudaError> {
        use cudarc::driver::sys::{
            CUdevice_attribute, CUflushGPUDirectRDMAWritesScope as Scope, CUflushGPUDirectRDMAWritesTarget as Target,
        };
        // CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST: the call is supported.
        if self.ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)? & 1 == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: plain enum arguments; the context is current on this thread.
        let r = unsafe {
            cudarc::driver::sys::cuFlushGPUDirectRDMAWrites(
                Target::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
                Scope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
            )
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Driver(format!("cuFlushGPUDirectRDMAWrites: {r:?}")));
        }
        Ok(())
    }

    /// The context (for device-to-device copies in benchmarks).
    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}
