//! Client memory the sidecar reads tensors from (saves) and writes them to
//! (loads): POSIX shared-memory segments the shim created and registered.
//!
//! Trust boundary: the name, length and every descriptor come from the
//! client. A segment is opened only under a plain `/name` (no path), must be
//! a regular object owned by the peer's uid and at least as large as claimed;
//! it is mapped **read-only**, and loads write with `pwrite` on the
//! descriptor, never through a mapping. Every access goes through
//! [`Region::src_ptr`] or [`Region::write_at`], which check bounds with
//! overflow-checked arithmetic, so no read or write leaves the region.
//!
//! Known limit: a client that shrinks its own segment (ftruncate) while a
//! copy reads it makes the sidecar fault (SIGBUS). The size is re-checked
//! before each save; a peer of the same uid could kill the sidecar anyway.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::config;

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("shm name {name:?}: {why}")]
    BadName { name: String, why: &'static str },
    #[error("shm segment {name:?}: {what}: {source}")]
    Os { name: String, what: &'static str, source: io::Error },
    #[error("shm segment {name:?} belongs to uid {owner_uid}, not to the client's uid {peer_uid}")]
    NotOwner { name: String, owner_uid: u32, peer_uid: u32 },
    #[error("shm segment {name:?} is not a regular shared-memory object")]
    NotRegular { name: String },
    #[error("shm segment {name:?} has {size_bytes} bytes, fewer than the {len_bytes} registered")]
    TooSmall { name: String, size_bytes: u64, len_bytes: u64 },
    #[error("bytes {offset_bytes}..{offset_bytes}+{len_bytes} lie outside region {region_id} of {region_bytes} bytes")]
    OutOfBounds { region_id: u32, offset_bytes: u64, len_bytes: u64, region_bytes: u64 },
}

/// Checks a shm_open name: one leading '/', no other '/', no NUL, not
/// "." or "..", at most NAME_MAX bytes.
pub fn validate_shm_name(name: &str) -> Result<(), RegionError> {
    let err = |why| Err(RegionError::BadName { name: name.to_string(), why });
    let Some(rest) = name.strip_prefix('/') else {
        return err("must start with '/'");
    };
    if rest.is_empty() {
        return err("empty");
    }
    if name.len() > config::SHM_NAME_BYTES_MAX {
        return err("longer than 255 bytes");
    }
    if rest.contains('/') {
        return err("must not contain '/' after the first character");
    }
    if rest.bytes().any(|b| b == 0 || b.is_ascii_control()) {
        return err("contains NUL or a control character");
    }
    if rest == "." || rest == ".." {
        return err("is '.' or '..'");
    }
    Ok(())
}

/// A registered shared-memory segment, mapped read-only.
pub struct Region {
    pub region_id: u32,
    pub shm_name: String,
    /// What the client registered (≤ the segment's size at registration).
    pub len_bytes: u64,
    fd: OwnedFd,
    /// Start of the read-only mapping of `len_bytes`; null when empty.
    ptr: *const u8,
}

// SAFETY: the mapping is read-only and owned by this Region until Drop;
// sharing `*const u8` to it across threads is like sharing a `&[u8]`. The
// client may change the bytes concurrently, which only changes what a copy
// sees (u8 has no invalid values); reads go through raw-pointer copies.
unsafe impl Send for Region {}
// SAFETY: as above; no interior mutability on our side.
unsafe impl Sync for Region {}

fn os(name: &str, what: &'static str) -> RegionError {
    RegionError::Os { name: name.to_string(), what, source: io::Error::last_os_error() }
}

impl Region {
    /// Opens, checks and maps the segment `shm_name` for a peer of `peer_uid`.
    pub fn open(region_id: u32, shm_name: &str, len_bytes: u64, peer_uid: u32) -> Result<Region, RegionError> {
        validate_shm_name(shm_name)?;
        let c = CString::new(shm_name).expect("validated: no NUL");
        // O_RDWR: loads pwrite into the segment; the mapping stays PROT_READ.
        // SAFETY: c is a valid NUL-terminated string; the result is checked.
        let raw = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0) };
        if raw < 0 {
            return Err(os(shm_name, "shm_open"));
        }
        // SAFETY: raw is a descriptor we just opened and own exclusively.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let st = fstat(fd.as_raw_fd()).map_err(|source| RegionError::Os { name: shm_name.to_string(), what: "fstat", source })?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(RegionError::NotRegular { name: shm_name.to_string() });
        }
        if st.st_uid != peer_uid {
            return Err(RegionError::NotOwner { name: shm_name.to_string(), owner_uid: st.st_uid, peer_uid });
        }
        if (st.st_size as u64) < len_bytes {
            return Err(RegionError::TooSmall { name: shm_name.to_string(), size_bytes: st.st_size as u64, len_bytes });
        }
        let ptr = if len_bytes == 0 {
            std::ptr::null()
        } else {
            if usize::try_from(len_bytes).is_err() || len_bytes > isize::MAX as u64 {
                return Err(RegionError::TooSmall { name: shm_name.to_string(), size_bytes: st.st_size as u64, len_bytes });
            }
            // MAP_POPULATE fills the page tables now, at registration, so the
            // copy at save time runs at memcpy speed without page faults.
            // SAFETY: a new shared read-only mapping of an fd we own, no
            // address hint; checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(std::ptr::null_mut(), len_bytes as usize, libc::PROT_READ, libc::MAP_SHARED | libc::MAP_POPULATE, fd.as_raw_fd(), 0)
            };
            if p == libc::MAP_FAILED {
                return Err(os(shm_name, "mmap"));
            }
            p as *const u8
        };
        Ok(Region { region_id, shm_name: shm_name.to_string(), len_bytes, fd, ptr })
    }

    fn check_bounds(&self, offset_bytes: u64, len_bytes: u64) -> Result<(), RegionError> {
        match offset_bytes.checked_add(len_bytes) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(RegionError::OutOfBounds { region_id: self.region_id, offset_bytes, len_bytes, region_bytes: self.len_bytes }),
        }
    }

    /// Checks that `len_bytes` at `offset_bytes` lie inside the region.
    pub fn contains(&self, offset_bytes: u64, len_bytes: u64) -> Result<(), RegionError> {
        self.check_bounds(offset_bytes, len_bytes)
    }

    /// The address of `offset_bytes`, after checking that `len_bytes` from
    /// there lie inside the mapping. The caller reads at most `len_bytes`
    /// from it, while it holds the Region.
    pub fn src_ptr(&self, offset_bytes: u64, len_bytes: u64) -> Result<*const u8, RegionError> {
        self.check_bounds(offset_bytes, len_bytes)?;
        if len_bytes == 0 {
            return Ok(std::ptr::NonNull::dangling().as_ptr());
        }
        Ok(self.ptr.wrapping_add(offset_bytes as usize))
    }

    /// Re-checks that the segment still holds every registered byte (a
    /// shrunk segment would fault the copy).
    pub fn check_size(&self) -> Result<(), RegionError> {
        let st = fstat(self.fd.as_raw_fd()).map_err(|source| RegionError::Os { name: self.shm_name.clone(), what: "fstat", source })?;
        if (st.st_size as u64) < self.len_bytes {
            return Err(RegionError::TooSmall { name: self.shm_name.clone(), size_bytes: st.st_size as u64, len_bytes: self.len_bytes });
        }
        Ok(())
    }

    /// Writes `bytes` at `offset_bytes` with pwrite (loads), bounds-checked.
    pub fn write_at(&self, offset_bytes: u64, bytes: &[u8]) -> Result<(), RegionError> {
        self.check_bounds(offset_bytes, bytes.len() as u64)?;
        let mut done = 0usize;
        while done < bytes.len() {
            let n = (bytes.len() - done).min(config::LOAD_PWRITE_BYTES_MAX);
            // SAFETY: bytes[done..done+n] is a live slice; the fd is ours.
            let r = unsafe {
                libc::pwrite(self.fd.as_raw_fd(), bytes.as_ptr().add(done).cast(), n, (offset_bytes + done as u64) as libc::off_t)
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(RegionError::Os { name: self.shm_name.clone(), what: "pwrite", source: e });
            }
            if r == 0 {
                return Err(RegionError::Os { name: self.shm_name.clone(), what: "pwrite", source: io::Error::from(io::ErrorKind::WriteZero) });
            }
            done += r as usize;
        }
        Ok(())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: unmapping exactly the mapping made in open(); every
            // pointer handed out by src_ptr is used only while the Region
            // is held (callers keep an Arc<Region> across a copy).
            unsafe {
                libc::munmap(self.ptr as *mut libc::c_void, self.len_bytes as usize);
            }
        }
    }
}

fn fstat(fd: i32) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: st is a valid out-pointer for one struct stat; fd is open.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded and filled the struct.
    Ok(unsafe { st.assume_init() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_names_with_path_tricks_are_refused() {
        for bad in ["", "/", "x", "/a/b", "/../etc/passwd", "/..", "/.", "/a\0b", "/a\nb", &format!("/{}", "x".repeat(255))] {
            assert!(validate_shm_name(bad).is_err(), "{bad:?}");
        }
        for good in ["/ckpt-1-0-0123456789abcdef", "/a", "/.hidden"] {
            validate_shm_name(good).unwrap();
        }
    }
}
