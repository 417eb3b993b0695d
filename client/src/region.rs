//! Host regions: POSIX shared-memory segments the trainer's tensors live in.
//!
//! Owns: creating a segment (`shm_open(O_CREAT | O_EXCL, 0600)` through the
//! `shared_memory` crate, name `/ckpt-<pid>-<region_id>-<16 hex>` as
//! docs/protocol.md says), reserving its pages (`posix_fallocate`) before
//! anything touches it, mapping it read-write in the trainer, and removing
//! its name when the region is freed.
//!
//! Reserved pages (a decision): a tmpfs segment is sparse after `ftruncate`,
//! and a page first touched when `/dev/shm` is full kills the toucher with
//! SIGBUS: the trainer copying a tensor in, or the sidecar writing a load
//! into it. Every segment is therefore backed in full at creation; a full
//! `/dev/shm` is [`RegionError::NoRoom`] (naming `/dev/shm` and the size),
//! returned before a byte is copied.
//!
//! Name lifetime (a decision): the name stays in `/dev/shm` for as long as
//! the region is allocated, not just until the sidecar has opened it, so that
//! a restarted sidecar (or a reconnect after the sidecar died) can reopen the
//! same memory by name and the trainer's tensors stay where they are. It is
//! unlinked when the region is freed (`free_region`, `ckpt_free`, closing or
//! dropping the client). A trainer killed with SIGKILL cannot unlink, so the
//! first allocation of every process sweeps segments of ours whose pid is
//! dead ([`sweep_stale`]); the sidecar may unlink the names of a session
//! whose peer is gone as well.
//!
//! Invariants:
//! - every page of a segment is allocated before `create` returns, so no
//!   access within `len_bytes` faults for want of memory (nobody else
//!   truncates our segments: they are 0600 and ours);
//! - the mapping is valid for `len_bytes` from `as_ptr()` until the region
//!   is dropped; nothing here reads or writes through it except the explicit
//!   copy helpers, which check bounds first;
//! - only the process that created a segment unlinks it (the sweep unlinks
//!   only segments of dead pids, owned by our uid).

use std::ffi::CString;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};

use shared_memory::{ShmemConf, ShmemError};

/// Longest segment we create: POSIX names are limited, tensors are not, but
/// a single mapping larger than this is surely a mistake (1 TiB).
pub const REGION_BYTES_MAX: u64 = 1 << 40;

/// One shared-memory segment, mapped read-write in this process.
pub struct ShmRegion {
    shmem: shared_memory::Shmem,
    region_id: u32,
    len_bytes: u64,
    /// A hand-over region (protocol.md, RegisterRegion): written only to
    /// fill a save before it is sent, never while one of it is unreleased.
    hand_over: bool,
    /// Cleared in a forked child: the name belongs to the parent.
    unlink_on_drop: AtomicBool,
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        if !self.unlink_on_drop.load(Ordering::Relaxed) {
            // Shmem unlinks in its own Drop (which runs after this) only if owner.
            self.shmem.set_owner(false);
        }
    }
}

// SAFETY: `Shmem` is !Send only because it holds the mapping's raw pointer.
// The mapping is process-wide (MAP_SHARED, not tied to a thread), is unmapped
// only in Drop (which needs ownership, so no other thread can be using the
// value), and this type never hands out references into it, only the address.
unsafe impl Send for ShmRegion {}
// SAFETY: every `&self` method reads only immutable fields or copies through
// the raw pointer with bounds checked; concurrent byte copies into shared
// memory are the caller's business, exactly as with any memory the sidecar
// also sees.
unsafe impl Sync for ShmRegion {}

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("a region of {len_bytes} bytes is not allowed (1..={max} bytes)")]
    BadLength { len_bytes: u64, max: u64 },
    #[error("creating shared memory segment {name} ({len_bytes} bytes) failed: {source}")]
    Create { name: String, len_bytes: u64, source: ShmemError },
    /// `/dev/shm` (a tmpfs) cannot hold the segment: refused at creation,
    /// before anything is copied (see the module's doc).
    #[error("no room in /dev/shm for a shared memory segment of {len_bytes} bytes ({}): {source} \
             (see `df -h /dev/shm`; free space there, or give the container a larger /dev/shm)", mib(*len_bytes))]
    NoRoom { len_bytes: u64, source: std::io::Error },
    #[error("reserving the pages of shared memory segment {name} ({len_bytes} bytes) failed: {source}")]
    Reserve { name: String, len_bytes: u64, source: std::io::Error },
}

/// `len_bytes` in MiB, for messages.
fn mib(len_bytes: u64) -> String {
    format!("{:.1} MiB", len_bytes as f64 / (1u64 << 20) as f64)
}

impl ShmRegion {
    /// Creates and maps a new segment of `len_bytes` for region `region_id`.
    pub fn create(region_id: u32, len_bytes: u64) -> Result<ShmRegion, RegionError> {
        if len_bytes == 0 || len_bytes > REGION_BYTES_MAX {
            return Err(RegionError::BadLength { len_bytes, max: REGION_BYTES_MAX });
        }
        sweep_stale_once();
        let mut tries = 0;
        loop {
            let name = segment_name(std::process::id(), region_id, random_u64());
            match ShmemConf::new().os_id(&name).size(len_bytes as usize).create() {
                Ok(shmem) => {
                    debug_assert!(shmem.is_owner());
                    // Dropped (unmapped and unlinked) on failure.
                    let region = ShmRegion {
                        shmem,
                        region_id,
                        len_bytes,
                        hand_over: false,
                        unlink_on_drop: AtomicBool::new(true),
                    };
                    reserve(&name, len_bytes)?;
                    return Ok(region);
                }
                // A name left by an earlier process with our pid: pick another suffix.
                Err(ShmemError::MappingIdExists) if tries < 8 => tries += 1,
                Err(source) => return Err(RegionError::Create { name, len_bytes, source }),
            }
        }
    }

    /// This region as a hand-over region (or not): see [`ShmRegion::hands_over`].
    pub fn handing_over(mut self, hand_over: bool) -> ShmRegion {
        self.hand_over = hand_over;
        self
    }

    /// Whether the client hands this region's bytes over at each save
    /// (registered so: a save of it commits even if the client dies before
    /// Released).
    pub fn hands_over(&self) -> bool {
        self.hand_over
    }

    /// Keeps the name when this region is dropped (a forked child must not
    /// remove its parent's shared memory).
    pub fn keep_name_on_drop(&self) {
        self.unlink_on_drop.store(false, Ordering::Relaxed);
    }

    pub fn region_id(&self) -> u32 {
        self.region_id
    }

    /// The `shm_open` name (with its leading `/`).
    pub fn shm_name(&self) -> &str {
        self.shmem.get_os_id()
    }

    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.shmem.as_ptr()
    }

    /// If `[ptr, ptr + len_bytes)` lies inside this region, its offset.
    pub fn offset_of(&self, ptr: usize, len_bytes: u64) -> Option<u64> {
        let base = self.as_ptr() as usize;
        let offset = ptr.checked_sub(base)? as u64;
        let end = offset.checked_add(len_bytes)?;
        (end <= self.len_bytes).then_some(offset)
    }

    /// Copies `src` into the region at `offset_bytes`.
    pub fn write_at(&self, offset_bytes: u64, src: &[u8]) -> Result<(), String> {
        self.check(offset_bytes, src.len())?;
        // SAFETY: `check` proved `offset_bytes + src.len() <= len_bytes`, and the
        // mapping is valid for `len_bytes` while `self` lives; `src` is a Rust
        // slice, so it cannot overlap the mapping's bytes mutably.
        unsafe { std::ptr::copy(src.as_ptr(), self.as_ptr().add(offset_bytes as usize), src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset_bytes` out of the region into `dst`.
    pub fn read_at(&self, offset_bytes: u64, dst: &mut [u8]) -> Result<(), String> {
        self.check(offset_bytes, dst.len())?;
        // SAFETY: bounds as in `write_at`; `dst` is exclusively ours.
        unsafe { std::ptr::copy(self.as_ptr().add(offset_bytes as usize), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn check(&self, offset_bytes: u64, len: usize) -> Result<(), String> {
        match offset_bytes.checked_add(len as u64) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(format!(
                "{len} bytes at offset {offset_bytes} do not fit region {} of {} bytes",
                self.region_id, self.len_bytes
            )),
        }
    }
}

/// Allocates every page of the new segment `name` (`posix_fallocate` through
/// a descriptor of its own: the crate keeps its one private), so that no
/// later access faults for want of memory. ENOSPC: `/dev/shm` is full.
fn reserve(name: &str, len_bytes: u64) -> Result<(), RegionError> {
    let err = |source: std::io::Error| match source.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::ENOMEM) | Some(libc::EFBIG) => RegionError::NoRoom { len_bytes, source },
        _ => RegionError::Reserve { name: name.to_string(), len_bytes, source },
    };
    let c = CString::new(name).map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    let len =
        libc::off_t::try_from(len_bytes).map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?;
    // SAFETY: `c` is a valid NUL-terminated string; the descriptor returned
    // is ours alone and closed below.
    let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is an open descriptor of a regular (tmpfs) file; the call
    // only allocates blocks within [0, len), which the segment already spans.
    let rc = unsafe { libc::posix_fallocate(fd, 0, len) };
    // SAFETY: `fd` was opened above and is not used after this.
    unsafe { libc::close(fd) };
    match rc {
        0 => Ok(()),
        rc => Err(err(std::io::Error::from_raw_os_error(rc))),
    }
}

/// `/ckpt-<pid>-<region_id>-<16 hex>`, as docs/protocol.md names segments.
pub fn segment_name(pid: u32, region_id: u32, suffix: u64) -> String {
    format!("/ckpt-{pid}-{region_id}-{suffix:016x}")
}

/// Parses a segment name (without the leading `/`, as listed in /dev/shm)
/// back into its pid, if it is one of ours.
pub fn parse_segment_name(file_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix("ckpt-")?;
    let mut parts = rest.split('-');
    let pid: u32 = parts.next()?.parse().ok()?;
    let _region_id: u32 = parts.next()?.parse().ok()?;
    let suffix = parts.next()?;
    if parts.next().is_some() || suffix.len() != 16 || !suffix.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(pid)
}

fn random_u64() -> u64 {
    let mut buf = [0u8; 8];
    // SAFETY: getrandom writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n == buf.len() as isize {
        return u64::from_ne_bytes(buf);
    }
    // No getrandom (old kernel, seccomp): time and a counter are unique enough
    // for a name that is created with O_EXCL and retried on collision.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let t =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    t ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn sweep_stale_once() {
    static DONE: AtomicBool = AtomicBool::new(false);
    if !DONE.swap(true, Ordering::Relaxed) {
        sweep_stale();
    }
}

/// Unlinks `/dev/shm/ckpt-<pid>-…` segments owned by our uid whose pid no
/// longer exists: what a trainer killed with SIGKILL left behind (shared
/// memory is RAM until unlinked). Returns how many it removed.
///
/// Caveat: "pid no longer exists" is judged in this process's pid namespace;
/// two trainers in different pid namespaces sharing one /dev/shm could see
/// each other's segments as stale. The sidecar holds its own mapping, so an
/// in-flight copy is never affected, only a later reopen by name.
pub fn sweep_stale() -> usize {
    let Ok(entries) = fs::read_dir("/dev/shm") else { return 0 };
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = parse_segment_name(name) else { continue };
        if pid == std::process::id() || pid_alive(pid) {
            continue;
        }
        match entry.metadata() {
            Ok(m) if m.uid() == uid => {}
            _ => continue,
        }
        let Ok(c) = CString::new(format!("/{name}")) else { continue };
        // SAFETY: `c` is a valid NUL-terminated string.
        if unsafe { libc::shm_unlink(c.as_ptr()) } == 0 {
            removed += 1;
        }
    }
    removed
}

fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_strangers_are_ignored() {
        let n = segment_name(42, 7, 0xdead_beef);
        assert_eq!(n, "/ckpt-42-7-00000000deadbeef");
        assert_eq!(parse_segment_name(&n[1..]), Some(42));
        assert_eq!(parse_segment_name("ckpt-42-7-xyz"), None);
        assert_eq!(parse_segment_name("ckpt-42-7-00000000deadbeef-1"), None);
        assert_eq!(parse_segment_name("other-42-7-00000000deadbeef"), None);
    }

    #[test]
    fn create_is_0600_named_and_unlinked_on_drop() {
        use std::os::unix::fs::PermissionsExt;
        let r = ShmRegion::create(3, 10_000).unwrap();
        let name = r.shm_name().to_string();
        assert!(name.starts_with(&format!("/ckpt-{}-3-", std::process::id())), "{name}");
        let path = format!("/dev/shm{name}");
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(meta.len() >= 10_000);
        r.write_at(9_990, &[7; 10]).unwrap();
        assert!(r.write_at(9_991, &[7; 10]).is_err());
        let mut back = [0; 10];
        r.read_at(9_990, &mut back).unwrap();
        assert_eq!(back, [7; 10]);
        let base = r.as_ptr() as usize;
        assert_eq!(r.offset_of(base + 100, 50), Some(100));
        assert_eq!(r.offset_of(base + 9_999, 2), None);
        assert_eq!(r.offset_of(base - 1, 1), None);
        drop(r);
        assert!(fs::metadata(&path).is_err(), "segment name left behind");
    }

    #[test]
    fn create_reserves_the_segments_pages() {
        // A sparse segment faulted in on a full /dev/shm would kill the
        // trainer with SIGBUS; every page is allocated up front.
        let len_bytes = 3 << 20;
        let r = ShmRegion::create(4, len_bytes).unwrap();
        let meta = fs::metadata(format!("/dev/shm{}", r.shm_name())).unwrap();
        assert!(meta.blocks() * 512 >= len_bytes, "{} bytes allocated of {len_bytes}", meta.blocks() * 512);
    }

    #[test]
    fn no_room_names_dev_shm_and_the_size() {
        let e = RegionError::NoRoom { len_bytes: 36 << 20, source: std::io::Error::from_raw_os_error(libc::ENOSPC) };
        let text = e.to_string();
        assert!(text.contains("/dev/shm") && text.contains("37748736 bytes (36.0 MiB)"), "{text}");
    }

    #[test]
    fn zero_and_huge_lengths_are_refused() {
        assert!(matches!(ShmRegion::create(1, 0), Err(RegionError::BadLength { .. })));
        assert!(matches!(ShmRegion::create(1, REGION_BYTES_MAX + 1), Err(RegionError::BadLength { .. })));
    }

    #[test]
    fn sweep_removes_segments_of_dead_pids_only() {
        // A pid far above pid_max is never alive.
        let dead = segment_name(4_000_000_000, 1, 0x1234);
        let mine = segment_name(std::process::id(), 999, 0x1234);
        for n in [&dead, &mine] {
            let c = CString::new(n.as_str()).unwrap();
            // SAFETY: valid C string; the fd is closed at once.
            let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o600) };
            assert!(fd >= 0);
            // SAFETY: `fd` was just opened here and is closed once.
            unsafe { libc::close(fd) };
        }
        sweep_stale();
        assert!(fs::metadata(format!("/dev/shm{dead}")).is_err());
        assert!(fs::metadata(format!("/dev/shm{mine}")).is_ok());
        let c = CString::new(mine.as_str()).unwrap();
        // SAFETY: `c` is a valid C string naming this test's own segment.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}
