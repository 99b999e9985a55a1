//! Status codes, the per-thread last-error message, and the guard every
//! exported call runs its body in (a panic becomes `EPS_ERR_INTERNAL`).

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use ::eps_worker::WorkerError;
use eps_control::ControlError;
use eps_proto::control::ErrorCode;

/// The result of every call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum eps_status {
    /// Success.
    EPS_OK = 0,
    /// An argument is out of range or malformed (a size, an index, a string).
    EPS_ERR_INVALID_ARGUMENT = 1,
    /// A pointer argument that must not be NULL is NULL.
    EPS_ERR_NULL_POINTER = 2,
    /// The handle is not one this library made, or it was closed.
    EPS_ERR_INVALID_HANDLE = 3,
    /// The call does not fit the handle's state (push before join, join
    /// twice, a pull of a tensor not pushed in this iteration...).
    EPS_ERR_STATE = 4,
    /// No tensor has that name or index.
    EPS_ERR_NOT_FOUND = 5,
    /// This worker's tensor declaration differs from the job's.
    EPS_ERR_MISMATCH = 6,
    /// Nothing came in time.
    EPS_ERR_TIMEOUT = 7,
    /// The control plane refused a request or cannot be reached.
    EPS_ERR_CONTROL = 8,
    /// The data-plane transport failed (a server closed its connection...).
    EPS_ERR_FABRIC = 9,
    /// This worker does not contribute to the current iteration: it left the
    /// job (a scale-down, or its lease ran out).
    EPS_ERR_LEFT = 10,
    /// Not supported by this build or this job.
    EPS_ERR_UNSUPPORTED = 11,
    /// The header the caller was compiled with does not match this library.
    EPS_ERR_VERSION = 12,
    /// A bug in the library (it was caught; the handle may be unusable).
    EPS_ERR_INTERNAL = 13,
}

use eps_status::*;

impl eps_status {
    /// Every status, in code order.
    pub(crate) const ALL: [eps_status; 14] = [
        EPS_OK,
        EPS_ERR_INVALID_ARGUMENT,
        EPS_ERR_NULL_POINTER,
        EPS_ERR_INVALID_HANDLE,
        EPS_ERR_STATE,
        EPS_ERR_NOT_FOUND,
        EPS_ERR_MISMATCH,
        EPS_ERR_TIMEOUT,
        EPS_ERR_CONTROL,
        EPS_ERR_FABRIC,
        EPS_ERR_LEFT,
        EPS_ERR_UNSUPPORTED,
        EPS_ERR_VERSION,
        EPS_ERR_INTERNAL,
    ];

    /// The text of `eps_status_string`.
    pub(crate) fn text(self) -> &'static CStr {
        match self {
            EPS_OK => c"success",
            EPS_ERR_INVALID_ARGUMENT => c"invalid argument",
            EPS_ERR_NULL_POINTER => c"NULL pointer argument",
            EPS_ERR_INVALID_HANDLE => c"invalid or closed handle",
            EPS_ERR_STATE => c"call out of order for the handle's state",
            EPS_ERR_NOT_FOUND => c"no such tensor",
            EPS_ERR_MISMATCH => c"tensor declaration differs from the job's",
            EPS_ERR_TIMEOUT => c"timed out",
            EPS_ERR_CONTROL => c"control plane error",
            EPS_ERR_FABRIC => c"transport error",
            EPS_ERR_LEFT => c"this worker left the job",
            EPS_ERR_UNSUPPORTED => c"not supported",
            EPS_ERR_VERSION => c"header and library versions differ",
            EPS_ERR_INTERNAL => c"internal error",
        }
    }
}

/// A failed call: its status and the message for `eps_last_error`.
#[derive(Debug)]
pub(crate) struct Fail {
    pub status: eps_status,
    pub message: String,
}

pub(crate) type Res<T = ()> = Result<T, Fail>;

pub(crate) fn fail(status: eps_status, message: impl Into<String>) -> Fail {
    Fail { status, message: message.into() }
}

/// A NULL check for the pointer argument `what`.
pub(crate) fn non_null<T>(p: *const T, what: &str) -> Res<()> {
    if p.is_null() { Err(fail(EPS_ERR_NULL_POINTER, format!("{what} is NULL"))) } else { Ok(()) }
}

/// A C string argument as UTF-8.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid for `'a`.
pub(crate) unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Res<&'a str> {
    non_null(p, what)?;
    // SAFETY: not NULL (checked) and NUL-terminated (the caller's contract).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map_err(|_| fail(EPS_ERR_INVALID_ARGUMENT, format!("{what} is not UTF-8")))
}

/// The control plane's address: `control` (`"IP:PORT"`, or the addresses
/// of a job's control planes `"IP:PORT,IP:PORT,..."`), or the
/// `EPS_CONTROL` environment variable when it is NULL.
///
/// # Safety
/// `control` is NULL or a NUL-terminated string.
pub(crate) unsafe fn control_arg(control: *const c_char) -> Res<eps_control::ControlAddrs> {
    let text = if control.is_null() {
        std::env::var("EPS_CONTROL").map_err(|_| fail(EPS_ERR_INVALID_ARGUMENT, "control is NULL and EPS_CONTROL is not set"))?
    } else {
        // SAFETY: the caller's contract.
        unsafe { c_str(control, "control") }?.to_string()
    };
    text.trim().parse().map_err(|_| {
        fail(EPS_ERR_INVALID_ARGUMENT, format!("control address {text:?} is not IP:PORT[,IP:PORT...] (as eps up prints it)"))
    })
}

/// The status a worker-library error maps to.
pub(crate) fn from_worker(e: &WorkerError) -> eps_status {
    match e {
        WorkerError::Control(c) => from_control(c),
        WorkerError::Spec(_) | WorkerError::Length { .. } | WorkerError::BadValues(_) => EPS_ERR_INVALID_ARGUMENT,
        WorkerError::Fabric(_) | WorkerError::Transfer { .. } | WorkerError::ServerGone { .. } => EPS_ERR_FABRIC,
        WorkerError::UnknownTensor(_) | WorkerError::UnknownTable(_) => EPS_ERR_NOT_FOUND,
        WorkerError::Sparse { .. } => EPS_ERR_INVALID_ARGUMENT,
        WorkerError::Timeout(_) | WorkerError::PullTimeout { .. } => EPS_ERR_TIMEOUT,
        WorkerError::Left(_) => EPS_ERR_LEFT,
        WorkerError::Unsupported(_) => EPS_ERR_STATE,
        _ => EPS_ERR_CONTROL,
    }
}

/// The status a control-plane error maps to.
pub(crate) fn from_control(e: &ControlError) -> eps_status {
    match e {
        ControlError::Rejected(r) => match r.code {
            ErrorCode::Mismatch => EPS_ERR_MISMATCH,
            ErrorCode::Invalid | ErrorCode::Limit => EPS_ERR_INVALID_ARGUMENT,
            _ => EPS_ERR_CONTROL,
        },
        ControlError::Timeout => EPS_ERR_TIMEOUT,
        _ => EPS_ERR_CONTROL,
    }
}

/// An error with its chain of causes, on one line.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

impl From<WorkerError> for Fail {
    fn from(e: WorkerError) -> Self {
        fail(from_worker(&e), chain(&e))
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// The calling thread's last error message (valid until its next call).
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Runs an exported call's body: clears the thread's last error, records the
/// message of a failure, and turns a panic into `EPS_ERR_INTERNAL`.
pub(crate) fn guard(name: &str, body: impl FnOnce() -> Res) -> eps_status {
    set_last_error("");
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => EPS_OK,
        Ok(Err(f)) => {
            set_last_error(&format!("{name}: {}", f.message));
            f.status
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            set_last_error(&format!("{name}: internal error (please report it): {what}"));
            EPS_ERR_INTERNAL
        }
    }
}
