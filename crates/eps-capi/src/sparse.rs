//! Sparse tables from C: rows pulled and gradient rows pushed by key (see
//! the worker library's `sparse.rs`). Keys are `uint64_t`, rows `float`,
//! `dim` values each; a call's input is checked whole before anything is
//! sent, so a refused call changes nothing.

use std::ffi::c_char;

use crate::status::{Res, c_str, eps_status, eps_status::*, fail, guard, non_null};
use crate::worker::{eps_worker, joined, put, with_joined};

/// `count` elements at `p` (NULL allowed when `count` is 0).
///
/// # Safety
/// `p` is NULL or points to `count` readable elements that stay valid for `'a`.
unsafe fn slice<'a, T>(p: *const T, count: usize, what: &str) -> Res<&'a [T]> {
    if count == 0 {
        return Ok(&[]);
    }
    non_null(p, what)?;
    // SAFETY: not NULL, and `count` readable elements by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, count) })
}

/// As [`slice`], writable.
///
/// # Safety
/// `p` is NULL or points to `count` writable elements that stay valid for `'a`.
unsafe fn slice_mut<'a, T>(p: *mut T, count: usize, what: &str) -> Res<&'a mut [T]> {
    if count == 0 {
        return Ok(&mut []);
    }
    non_null(p, what)?;
    // SAFETY: not NULL, and `count` writable elements by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, count) })
}

fn table_id(table: u32) -> Res<u16> {
    u16::try_from(table).map_err(|_| fail(EPS_ERR_NOT_FOUND, format!("table {table}: no such table")))
}

/// The index of the sparse table named `name` (what the other `eps_sparse_*`
/// calls take).
///
/// # Safety
/// `name` is a NUL-terminated string; `table` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_table_find(w: *mut eps_worker, name: *const c_char, table: *mut u32) -> eps_status {
    guard("eps_table_find", || {
        // SAFETY: the caller's contract.
        let name = unsafe { c_str(name, "name") }?;
        non_null(table, "table")?;
        let t = with_joined(w, true, |j| Ok(j.w.table(name)?))?;
        // SAFETY: the caller's contract.
        unsafe { put(table, u32::from(t), "table") }
    })
}

/// The row dimension (values per row) of sparse table `table`.
///
/// # Safety
/// `dim` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_table_dim(w: *mut eps_worker, table: u32, dim: *mut u32) -> eps_status {
    guard("eps_table_dim", || {
        non_null(dim, "dim")?;
        let d = with_joined(w, true, |j| Ok(j.w.table_dim(table_id(table)?)?))?;
        // SAFETY: the caller's contract.
        unsafe { put(dim, d as u32, "dim") }
    })
}

/// Pulls the rows of `keys` (a key may repeat) as of the worker's current
/// iteration into `rows`: `rows_len` must be `count * dim` floats, row `i`
/// the row of `keys[i]`. Rows never seen are created by their servers from
/// the table's initializer.
///
/// # Safety
/// `keys` points to `count` readable keys, `rows` to `rows_len` writable
/// floats (either may be NULL when its count is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_sparse_pull(
    w: *mut eps_worker,
    table: u32,
    keys: *const u64,
    count: usize,
    rows: *mut f32,
    rows_len: usize,
) -> eps_status {
    guard("eps_sparse_pull", || {
        // SAFETY: the caller's contract.
        let keys = unsafe { slice(keys, count, "keys") }?;
        // SAFETY: the caller's contract.
        let out = unsafe { slice_mut(rows, rows_len, "rows") }?;
        joined(w, |j| Ok(j.w.sparse_pull(table_id(table)?, keys, out)?))
    })
}

/// Pulls the rows of `keys` as of the worker's current iteration into the
/// worker's own row buffer, one row per distinct key (copied out of the
/// registered buffer its servers write, so no copy by the caller): `*rows`
/// points to those rows (`*row_count` of them, `dim` floats each), and
/// `index[i]` is the row of `keys[i]`. The rows stay valid until the table's
/// next pull on this worker, or its close.
///
/// # Safety
/// `keys` points to `count` readable keys and `index` to `count` writable
/// `uint32_t`s (NULL when `count` is 0); `rows` and `row_count` are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_sparse_pull_rows(
    w: *mut eps_worker,
    table: u32,
    keys: *const u64,
    count: usize,
    index: *mut u32,
    rows: *mut *const f32,
    row_count: *mut usize,
) -> eps_status {
    guard("eps_sparse_pull_rows", || {
        // SAFETY: the caller's contract.
        let keys = unsafe { slice(keys, count, "keys") }?;
        // SAFETY: the caller's contract.
        let index = unsafe { slice_mut(index, count, "index") }?;
        non_null(rows, "rows")?;
        non_null(row_count, "row_count")?;
        let (p, n) = joined(w, |j| Ok(j.w.sparse_pull_rows(table_id(table)?, keys, index)?))?;
        // SAFETY: the caller's contract.
        unsafe { put(rows, p, "rows") }?;
        // SAFETY: the caller's contract.
        unsafe { put(row_count, n, "row_count") }
    })
}

/// Pushes the current iteration's gradient rows of `keys`: `grads_len` must
/// be `count * dim` floats, row `i` for `keys[i]` (a key may repeat: its
/// rows are summed in order). Once per table and iteration; returns when
/// the rows are on their way (see `eps_sparse_flush`). A table not pushed in
/// an iteration is pushed empty when the worker waits for its parameters.
///
/// # Safety
/// `keys` points to `count` readable keys and `grads` to `grads_len`
/// readable floats (NULL when their count is 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eps_sparse_push(
    w: *mut eps_worker,
    table: u32,
    keys: *const u64,
    count: usize,
    grads: *const f32,
    grads_len: usize,
) -> eps_status {
    guard("eps_sparse_push", || {
        // SAFETY: the caller's contract.
        let keys = unsafe { slice(keys, count, "keys") }?;
        // SAFETY: the caller's contract.
        let grads = unsafe { slice(grads, grads_len, "grads") }?;
        joined(w, |j| Ok(j.w.sparse_push(table_id(table)?, keys, grads)?))
    })
}

/// Waits until the servers applied this worker's last push of `table`.
#[unsafe(no_mangle)]
pub extern "C" fn eps_sparse_flush(w: *mut eps_worker, table: u32) -> eps_status {
    guard("eps_sparse_flush", || joined(w, |j| Ok(j.w.sparse_flush(table_id(table)?)?)))
}
