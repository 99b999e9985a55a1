//! GPU memory for the `rdma` provider: a device allocation exported as a dmabuf
//! (`cuMemGetHandleForAddressRange`) and registered with the NIC through
//! `ibv_reg_dmabuf_mr` (GPUDirect RDMA): peers WRITE into and READ from it, and
//! work requests gather from it, with no copy through host memory. Needs a GPU
//! and driver that export dmabufs, and a NIC and kernel that import them; errors
//! say which is missing.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUmemRangeHandleType, CUresult};
use cudarc::driver::{CudaSlice, DevicePtr};
use eps_fabric::{Access, FabricError};
use eps_rdma::{DeviceMemory, RdmaMr, RdmaPd};

use crate::{CudaError, Gpu};

/// Exported ranges are whole multiples of this (the driver wants host-page
/// alignment; allocations start 2 MiB-aligned).
const ALIGN: usize = 64 << 10;

/// A GPU allocation with its dmabuf, for [`register`].
#[derive(Debug)]
pub struct GpuBuffer {
    gpu: Arc<Gpu>,
    buf: Mutex<CudaSlice<u8>>,
    fd: OwnedFd,
    ptr: u64,
    len: usize,
}

impl GpuBuffer {
    /// `len` zeroed bytes of GPU memory, exported as a dmabuf.
    pub fn new(gpu: Arc<Gpu>, len: usize) -> Result<Self, CudaError> {
        if gpu.ctx().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? == 0 {
            return Err(CudaError::Driver(format!("{} cannot export dmabufs (no GPUDirect RDMA through dmabuf)", gpu.info())));
        }
        let size = len.max(1).div_ceil(ALIGN) * ALIGN;
        let buf = gpu.alloc::<u8>(size)?;
        let (ptr, _sync) = buf.device_ptr(gpu.stream());
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: `fd` is a valid out-parameter; the range is the allocation just
        // made, whole and aligned.
        let r = unsafe {
            cudarc::driver::sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::os::raw::c_int).cast(),
                ptr,
                size,
                CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        if r != CUresult::CUDA_SUCCESS || fd < 0 {
            return Err(CudaError::Driver(format!("cuMemGetHandleForAddressRange (dmabuf export): {r:?}")));
        }
        // SAFETY: the driver returned a new descriptor that we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        drop(_sync);
        Ok(Self { gpu, buf: Mutex::new(buf), fd, ptr, len: len.max(1) })
    }
}

impl DeviceMemory for GpuBuffer {
    fn dmabuf_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
    fn dmabuf_offset(&self) -> u64 {
        0
    }
    fn len(&self) -> usize {
        self.len
    }
    fn iova(&self) -> u64 {
        self.ptr
    }
    fn read(&self, offset: usize, out: &mut [u8]) {
        let b = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let r = self.gpu.stream().memcpy_dtoh(&b.slice(offset..offset + out.len()), out);
        let r = r.and_then(|()| self.gpu.stream().synchronize());
        if let Err(e) = r {
            // The trait has no error path: a failed copy leaves `out` poisoned.
            out.fill(0xFF);
            eps_fabric::stats::warn(&format!("eps-cuda: reading GPU memory failed: {e}"));
        }
    }
    fn write(&self, offset: usize, data: &[u8]) {
        let mut b = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        let mut dst = b.slice_mut(offset..offset + data.len());
        let r = self.gpu.stream().memcpy_htod(data, &mut dst);
        let r = r.and_then(|()| self.gpu.stream().synchronize());
        if let Err(e) = r {
            eps_fabric::stats::warn(&format!("eps-cuda: writing GPU memory failed: {e}"));
        }
    }
}

/// Registers `buf` with the NIC of `pd` (GPUDirect RDMA): the region's address
/// is the device pointer.
pub fn register(pd: &RdmaPd, buf: GpuBuffer, access: Access) -> Result<RdmaMr, FabricError> {
    pd.register_dmabuf(Box::new(buf), access)
}
