//! A helper of the Python package, not of C callers: the save key of a
//! list of numpy arrays (`ckpt_sidecar._tree.quick_key`), read from the
//! arrays' own fields in one pass instead of five Python attribute reads
//! per array, each of which makes a new object.
//!
//! The layouts read are CPython's `PyListObject` and numpy's public
//! `PyArrayObject_fields` (numpy/ndarraytypes.h, the same in numpy 1 and
//! 2). The object header's size is the caller's (`object.__basicsize__`),
//! so a free-threaded interpreter's longer header is handled, and the
//! caller checks the fields read against the attributes of sample arrays
//! before it trusts the function (ckpt_sidecar._native_key).

use std::ffi::{c_int, c_void};

use super::args::out;
use super::errors::{guard, invalid};
use crate::error::Error;

/// Reads a pointer-sized word `off` bytes into the object at `p`.
///
/// # Safety
/// `p + off .. p + off + 8` lies inside a live object.
unsafe fn word(p: *const u8, off: usize) -> usize {
    // SAFETY: the caller's contract.
    unsafe { p.add(off).cast::<usize>().read_unaligned() }
}

/// Writes the key of the numpy arrays in the Python list `list` into
/// `out` (room for `cap` words) and their count in *out_len: for each
/// array its data pointer, its number of dimensions, each dimension, each
/// stride, and its dtype object's address. Two lists whose keys are equal
/// hold arrays over the same memory with the same shapes, strides and
/// dtype objects, in the same order. CKPT_E_INVALID when an item is not
/// exactly of `ndarray_type` (a subclass or another object: the caller
/// keys the list another way); CKPT_E_TRUNCATED when `cap` words are too
/// few (the count needed is stored).
///
/// # Safety
/// Only for ckpt_sidecar: the caller holds the GIL for the whole call (it
/// calls through ctypes.PyDLL), `list` is a live Python list,
/// `header_bytes` is this interpreter's `object.__basicsize__`,
/// `ndarray_type` is `numpy.ndarray`, and the caller has checked that
/// arrays are laid out as read here; `out` is writable for `cap` words.
#[no_mangle]
pub unsafe extern "C" fn ckpt_py_arrays_key(
    list: *const c_void,
    header_bytes: usize,
    ndarray_type: *const c_void,
    out_words: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> c_int {
    guard(|| {
        let out_len = out(out_len, "out_len")?;
        if list.is_null() || ndarray_type.is_null() || header_bytes < 16 {
            return Err(invalid("list and ndarray_type must be objects, header_bytes at least 16"));
        }
        let list = list.cast::<u8>();
        // The header ends with ob_type in every build; a list then has its
        // length (ob_size) and its items' array (ob_item).
        // SAFETY: `list` is a live list (the caller's contract), so these
        // fields exist; the GIL keeps it from changing during the call.
        let (len, items) = unsafe { (word(list, header_bytes), word(list, header_bytes + 8) as *const *const u8) };
        let mut n = 0usize;
        let mut put = |v: u64| {
            if n < cap {
                // SAFETY: `out_words` is writable for `cap` words (the caller's contract), n < cap.
                unsafe { out_words.add(n).write(v) };
            }
            n += 1;
        };
        for i in 0..len {
            // SAFETY: i < ob_size, so ob_item[i] is a live item (the GIL is held).
            let a = unsafe { items.add(i).read() };
            // SAFETY: every object starts with the header, ob_type its last word.
            if unsafe { word(a, header_bytes - 8) } != ndarray_type as usize {
                return Err(invalid(format!("item {i} is not exactly a numpy.ndarray")));
            }
            // PyArrayObject_fields after the header: data, nd (an int,
            // padded), dimensions, strides, base, descr.
            // SAFETY: `a` is an ndarray (its type checked), laid out as the caller checked.
            let (data, nd, dims, strides, descr) = unsafe {
                (
                    word(a, header_bytes),
                    a.add(header_bytes + 8).cast::<i32>().read_unaligned(),
                    word(a, header_bytes + 16) as *const u64,
                    word(a, header_bytes + 24) as *const u64,
                    word(a, header_bytes + 40),
                )
            };
            let nd = usize::try_from(nd).map_err(|_| invalid(format!("item {i} has {nd} dimensions")))?;
            put(data as u64);
            put(nd as u64);
            for k in 0..nd {
                // SAFETY: an ndarray's dimensions array holds nd values.
                put(unsafe { dims.add(k).read_unaligned() });
            }
            for k in 0..nd {
                // SAFETY: an ndarray's strides array holds nd values.
                put(unsafe { strides.add(k).read_unaligned() });
            }
            put(descr as u64);
        }
        // SAFETY: checked non-NULL; writable by the caller's contract.
        unsafe { *out_len = n };
        if n > cap {
            return Err(Error::Truncated { len_bytes: 8 * n as u64, cap_bytes: 8 * cap as u64 });
        }
        Ok(())
    })
}
