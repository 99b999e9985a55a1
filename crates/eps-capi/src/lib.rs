//! # libeps: the C ABI of EPS
//!
//! `libeps.so` and `libeps.a`, with the header `include/eps.h` generated from
//! this crate (cbindgen; a test fails when the committed header differs).
//! Every framework uses EPS through it; the Python package is a thin layer
//! over it.
//!
//! Conventions (those of libibverbs, NCCL and UCX):
//! - opaque handles (`eps_worker`, `eps_cluster`); every handle this library
//!   gives out is recorded, so a NULL, foreign, mistyped or closed handle is
//!   refused with a status, never dereferenced;
//! - every call returns an [`eps_status`] and never aborts the process: a
//!   panic inside is caught at the boundary and returned as
//!   `EPS_ERR_INTERNAL`; [`eps_status_string`] names a status and
//!   [`eps_last_error`] gives the calling thread's last failure in detail;
//! - results through out-parameters; structs the caller fills carry their
//!   size, so old programs keep working with newer libraries;
//! - version macros in the header and [`eps_version`] /
//!   [`eps_check_version`] at run time.
//!
//! # Thread safety
//! Every call may be made from any thread. Calls on one handle are
//! serialized by the handle (a blocking call on a worker holds it).
//!
//! # Safety
//! The exported functions are `unsafe` because they take raw pointers; each
//! says what it requires of them. This crate is the ABI's gate: raw pointers
//! are checked for NULL, read once into owned values, and never kept.

mod any;
mod cluster;
mod handle;
mod sparse;
mod status;
mod types;
mod worker;

use std::ffi::c_char;

pub use cluster::*;
pub use sparse::*;
pub use status::eps_status;
pub use types::*;
pub use worker::*;

use status::eps_status::*;
use status::{fail, guard, non_null};

/// Major version: a change means an incompatible ABI.
pub const EPS_VERSION_MAJOR: u32 = 0;
/// Minor version: additions only.
pub const EPS_VERSION_MINOR: u32 = 2;
/// Patch version.
pub const EPS_VERSION_PATCH: u32 = 0;
/// `EPS_VERSION_MAJOR * 10000 + EPS_VERSION_MINOR * 100 + EPS_VERSION_PATCH`,
/// as the header was generated: pass it to `eps_check_version`.
pub const EPS_VERSION: u32 = EPS_VERSION_MAJOR * 10000 + EPS_VERSION_MINOR * 100 + EPS_VERSION_PATCH;

/// This library's version, encoded as `EPS_VERSION`.
#[unsafe(no_mangle)]
pub extern "C" fn eps_version() -> u32 {
    EPS_VERSION
}

/// Checks that this library can serve a program compiled with the header of
/// version `header_version` (pass `EPS_VERSION`): the major versions must be
/// equal and the library's minor version at least the header's.
#[unsafe(no_mangle)]
pub extern "C" fn eps_check_version(header_version: u32) -> eps_status {
    status::guard("eps_check_version", || {
        let (major, minor) = (header_version / 10000, header_version / 100 % 100);
        if major != EPS_VERSION_MAJOR || minor > EPS_VERSION_MINOR {
            return Err(status::fail(
                EPS_ERR_VERSION,
                format!(
                    "the program was compiled with eps.h {major}.{minor}.{}, this library is {EPS_VERSION_MAJOR}.{EPS_VERSION_MINOR}.{EPS_VERSION_PATCH}",
                    header_version % 100
                ),
            ));
        }
        Ok(())
    })
}

/// A static, NUL-terminated English name of `status` (never NULL; an
/// unknown value gives "unknown status").
#[unsafe(no_mangle)]
pub extern "C" fn eps_status_string(status: u32) -> *const c_char {
    eps_status::ALL.iter().find(|s| **s as u32 == status).map_or(c"unknown status".as_ptr(), |s| s.text().as_ptr())
}

/// The calling thread's last failure in detail (which call, what and why);
/// an empty string after a call that succeeded. Owned by the library: valid
/// until this thread's next call.
#[unsafe(no_mangle)]
pub extern "C" fn eps_last_error() -> *const c_char {
    status::last_error_ptr()
}

/// The initial values the servers give elements `first .. first + count` of
/// the flat parameter space of a job with seed `seed` (uniform in
/// [-0.01, 0.01), a pure function of seed and index), into `out`: a program
/// that trains the same model alone can start where EPS starts.
///
/// # Safety
/// `out` has room for `count` floats.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_initial_params(seed: u64, first: u64, out: *mut f32, count: usize) -> eps_status {
    guard("eps_initial_params", || {
        non_null(out, "out")?;
        // The indices must not wrap, and the buffer's byte size must fit an isize.
        // (The last index is first + count - 1.)
        let n = u64::try_from(count).ok().filter(|&n| n == 0 || first.checked_add(n - 1).is_some());
        if n.is_none() || count > isize::MAX as usize / size_of::<f32>() {
            return Err(fail(
                EPS_ERR_INVALID_ARGUMENT,
                format!("first {first} + count {count} passes the last index (2^64 - 1)"),
            ));
        }
        for i in 0..count {
            // Cannot wrap: first + count - 1 fits, checked above.
            let index = first + i as u64;
            // SAFETY: `i < count` and `out` has room for `count` floats.
            unsafe { out.add(i).write(eps_proto::init::param(seed, index)) };
        }
        Ok(())
    })
}
