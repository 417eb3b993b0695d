//! The ABI's connection calls: connect, close, reconnect, whether
//! connected, and the settings later requests use (timeout, lazy release,
//! rank).

use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::Duration;

use super::args::{c_str, client, out};
use super::errors::{guard, invalid};
use super::process::default_client_ptr;
use super::types::ckpt_client;
use crate::client::Client;

/// Connects to the sidecar at `path`, or (path NULL) at $CKPT_SIDECAR_SOCKET,
/// else $XDG_RUNTIME_DIR/ckpt-sidecar/sidecar.sock, else
/// /tmp/ckpt-sidecar-<uid>/sidecar.sock. On success stores the client in *out.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `out` points to writable storage.
#[no_mangle]
pub unsafe extern "C" fn ckpt_connect(path: *const c_char, out: *mut *mut ckpt_client) -> c_int {
    guard(|| {
        let out = self::out(out, "out")?;
        // SAFETY: the caller's contract.
        let path = if path.is_null() { None } else { Some(unsafe { c_str(path, "path") }?) };
        let client = Client::connect(path.map(Path::new))?;
        // SAFETY: `out` is non-NULL and writable by the caller's contract.
        unsafe { *out = ckpt_client::new_boxed(client) };
        Ok(())
    })
}

/// Says goodbye to the sidecar and frees the client: saves already released
/// still commit, saves not released are aborted, regions are unmapped and
/// their shared memory removed. NULL is a no-op. The default client
/// (ckpt_default_client) lives as long as the process and cannot be closed.
///
/// # Safety
/// `client` is NULL or from ckpt_connect and not used after this call.
#[no_mangle]
pub unsafe extern "C" fn ckpt_close(client: *mut ckpt_client) -> c_int {
    guard(|| {
        if client.is_null() {
            return Ok(());
        }
        if std::ptr::eq(client, default_client_ptr()) {
            return Err(invalid("the default client lives as long as the process; it cannot be closed"));
        }
        // SAFETY: from ckpt_client::new_boxed (Box::into_raw) in ckpt_connect,
        // and the caller gives up its use.
        let boxed = unsafe { Box::from_raw(client) };
        boxed.client.close();
        Ok(())
    })
}

/// Connects again if the sidecar went away (re-registering every region
/// under its old name, so tensor pointers stay valid). CKPT_OK if connected.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_reconnect(client: *mut ckpt_client) -> c_int {
    // SAFETY: the caller's contract.
    guard(|| unsafe { self::client(client) }?.client.reconnect())
}

/// Whether the connection is up: 1 yes, 0 no (the next call will try to reconnect).
///
/// # Safety
/// `client` is NULL or a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_connected(client: *const ckpt_client) -> c_int {
    // SAFETY: the caller's contract.
    catch_unwind(AssertUnwindSafe(|| unsafe { client.as_ref() }.is_some_and(|c| c.client.is_connected()) as c_int))
        .unwrap_or(0)
}

/// Limits how long ckpt_load, ckpt_list, ckpt_alloc, ckpt_free and
/// ckpt_status_json wait for the sidecar's answer (timeout_ms < 0: no limit,
/// the default). Saves are timed by ckpt_wait's own argument.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_set_timeout(client: *mut ckpt_client, timeout_ms: i64) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        let c = unsafe { self::client(client) }?;
        c.client.set_request_timeout(u64::try_from(timeout_ms).ok().map(Duration::from_millis));
        Ok(())
    })
}

/// on != 0: later saves ask for a lazy release. For a trainer that does not
/// block on CKPT_RELEASED right after ckpt_save (it computes meanwhile): the
/// sidecar then checksums each block while copying it, one pass over memory
/// fewer, so it disturbs the computation less, but Released comes later.
/// on == 0 (the default): Released as early as possible.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_set_lazy_release(client: *mut ckpt_client, on: c_int) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe { self::client(client) }?.client.set_lazy_release(on != 0);
        Ok(())
    })
}

/// This trainer is rank `rank` of `world_size` ranks (torch.distributed's
/// numbering). With world_size > 1, later ckpt_save calls send this rank's
/// part of a checkpoint every rank saves under the same step; the sidecar
/// commits it once every rank's part is there, and only then is any rank's
/// save durable. Files are named `rank-RRRRR-of-WWWWW-...`.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn ckpt_set_rank(client: *mut ckpt_client, rank: u32, world_size: u32) -> c_int {
    guard(|| {
        // SAFETY: the caller's contract.
        unsafe { self::client(client) }?.client.set_rank(rank, world_size)?;
        Ok(())
    })
}
