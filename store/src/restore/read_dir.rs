//! Reading one folder's files through one engine, each checked as its bytes
//! arrive ([`super::check::FileCheck`]), into its place in a load's memory
//! or through a verify's window.
//!
//! Invariant: a read that faults on the destination (EFAULT) is reported as
//! the memory's failure, never as damage of the file.

use std::os::fd::AsRawFd;
use std::path::Path;

use super::check::FileCheck;
use super::{problem, LoadError, Problem};
use crate::config::{self, DIRECT_ALIGN_BYTES};
use crate::format::Index;
use crate::io::{self as eio, FileIo, IoPolicy, OpKind};

/// What one directory's reader thread found ([`read_and_check`]).
pub(super) struct DirRead {
    pub(super) problems: Vec<Problem>,
    /// Each file's data-section start.
    pub(super) starts: Vec<(String, u64)>,
    pub(super) engine: String,
    /// A read into the destination failed with EFAULT: the memory, not the file.
    pub(super) dest_failed: Option<String>,
}

/// Where a file is read to: its own place in a buffer large enough for all
/// of it (load), or a ring window it streams through (verify).
#[derive(Clone, Copy)]
pub(super) enum Dest {
    Whole(*mut u8),
    Window(*mut u8, u64),
}

/// Reads the files `targets` (index into `index.ckpt.files`, destination) of
/// one directory and checks each as its bytes arrive: length, header against
/// the index, every tensor's checksum (computed while later chunks are still
/// in flight), the file checksum. Returns the problems, the data-section
/// start of each file, and the engine name.
///
/// # Safety
/// Each destination must be valid, writable and otherwise untouched for the
/// whole call: for `Whole`, the file's length rounded up to the O_DIRECT
/// block; for `Window`, the window.
pub(super) unsafe fn read_and_check(
    step_dir: &Path,
    index: &Index,
    targets: &[(usize, Dest)],
    reader: &mut DirReader,
) -> DirRead {
    let mut any_direct = false;
    let mut problems = Vec::new();
    let mut opened = Vec::new();
    let mut ios = Vec::new();
    let mut checks = Vec::new();
    for &(fi, dest) in targets {
        let f = &index.ckpt.files[fi];
        let path = step_dir.join(&f.name);
        let (file, direct) = match eio::open_for_read_with(&path, reader.want_direct) {
            Ok(f) => f,
            Err(e) => {
                problems.push(problem(Some(&f.name), None, format!("cannot open: {e}")));
                continue;
            }
        };
        let actual = file.metadata().map(|m| m.len()).unwrap_or(0);
        if actual != f.len_bytes {
            problems.push(problem(Some(&f.name), None, format!("{actual} bytes where the index says {}", f.len_bytes)));
            continue;
        }
        any_direct |= direct;
        let io_len = if direct { config::align_up(f.len_bytes, DIRECT_ALIGN_BYTES) } else { f.len_bytes };
        let (ptr, window_bytes) = match dest {
            Dest::Whole(p) => (p, 0),
            Dest::Window(p, w) => (p, w),
        };
        ios.push(FileIo { fd: file.as_raw_fd(), ptr, io_len, file_len: f.len_bytes, window_bytes });
        checks.push(FileCheck::new(f, index.tensors_of(&f.name).collect()));
        opened.push(file);
    }
    let mut check_problems: Vec<Problem> = Vec::new();
    let r = eio::drive(reader.engine.as_mut(), OpKind::Read, &ios, config::CHUNK_BYTES_DEFAULT, |i, bytes| {
        checks[i].feed(bytes, &mut check_problems);
    });
    let mut dest_failed = None;
    if let Err(e) = r {
        let name = match &e {
            eio::DriveError::Io { file_idx, .. }
            | eio::DriveError::ShortRead { file_idx, .. }
            | eio::DriveError::ShortWrite { file_idx, .. } => Some(checks[*file_idx].file.name.as_str()),
            eio::DriveError::Engine(_) | eio::DriveError::Source(_) => None,
        };
        if e.errno() == Some(libc::EFAULT) {
            // The kernel could not write the destination's pages: the
            // memory failed (a client's segment shrunk or unbacked), not the file.
            dest_failed = Some(format!("{}: the destination memory faulted: {e}", name.unwrap_or("a shard")));
        } else {
            problems.push(problem(name, None, format!("read failed: {e}")));
        }
    }
    problems.extend(check_problems);
    let mut starts = Vec::new();
    for c in &checks {
        c.finish(&mut problems);
        starts.push((c.file.name.clone(), c.data_start().unwrap_or(0)));
    }
    let engine = eio::EngineChoice { direct: any_direct, ..reader.choice.clone() }.name();
    DirRead { problems, starts, engine, dest_failed }
}

/// An engine for reading one directory, opened once and reused for its files.
pub(super) struct DirReader {
    choice: eio::EngineChoice,
    want_direct: eio::Want,
    engine: Box<dyn eio::IoEngine>,
}

impl DirReader {
    pub(super) fn open(dir: &Path, policy: IoPolicy) -> Result<DirReader, LoadError> {
        let (choice, want_direct) = eio::probe_for_read(dir, policy)?;
        let engine = choice.open_engine().map_err(|e| LoadError::Io {
            path: dir.to_path_buf(),
            what: "start I/O engine",
            source: e,
        })?;
        Ok(DirReader { choice, want_direct, engine })
    }
}
