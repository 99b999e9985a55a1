//! Handles: every handle this library gives out is recorded here with its
//! kind, so that a NULL, foreign, mistyped or closed handle is refused with a
//! status instead of being dereferenced. A closed handle's small allocation is
//! kept (never freed, never reused), so a second close, or a call after close,
//! finds it marked closed rather than reaching freed or reused memory.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::status::{Res, eps_status, fail};

/// The kinds of handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Worker,
    Cluster,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Worker => "an eps_worker",
            Kind::Cluster => "an eps_cluster",
        }
    }
}

/// Address -> (kind, open).
static LIVE: Mutex<Option<HashMap<usize, (Kind, bool)>>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut HashMap<usize, (Kind, bool)>) -> R) -> R {
    let mut g = LIVE.lock().unwrap_or_else(|p| p.into_inner());
    f(g.get_or_insert_with(HashMap::new))
}

/// Gives out `b` as a handle of `kind`.
pub(crate) fn give<T>(kind: Kind, b: Box<T>) -> *mut T {
    let p = Box::into_raw(b);
    with(|m| m.insert(p as usize, (kind, true)));
    p
}

fn check(p: usize, kind: Kind, closing: bool) -> Res {
    if p == 0 {
        return Err(fail(eps_status::EPS_ERR_NULL_POINTER, format!("the handle is NULL (expected {})", kind.name())));
    }
    with(|m| match m.get_mut(&p) {
        None => {
            Err(fail(eps_status::EPS_ERR_INVALID_HANDLE, format!("not a handle this library made (expected {})", kind.name())))
        }
        Some((k, _)) if *k != kind => {
            Err(fail(eps_status::EPS_ERR_INVALID_HANDLE, format!("{} passed where {} is expected", k.name(), kind.name())))
        }
        Some((_, false)) => Err(fail(eps_status::EPS_ERR_INVALID_HANDLE, format!("{} that was closed already", kind.name()))),
        Some((_, open)) => {
            if closing {
                *open = false;
            }
            Ok(())
        }
    })
}

/// The object behind an open handle of `kind`.
pub(crate) fn get<'a, T>(p: *mut T, kind: Kind) -> Res<&'a T> {
    check(p as usize, kind, false)?;
    // SAFETY: `p` was made by `give` from a Box of this kind (the registry says
    // so) and its allocation is never freed, so it points to a live `T`.
    Ok(unsafe { &*p })
}

/// Marks an open handle closed and returns its object, so the caller can
/// release what it holds. Its allocation stays (see the module docs).
pub(crate) fn close<'a, T>(p: *mut T, kind: Kind) -> Res<&'a T> {
    check(p as usize, kind, true)?;
    // SAFETY: as in `get`: a live allocation made by `give` for this kind.
    Ok(unsafe { &*p })
}
