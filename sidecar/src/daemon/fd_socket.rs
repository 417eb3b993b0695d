//! The session's socket as a byte stream that keeps the file descriptors a
//! client passes with SCM_RIGHTS (the VMM allocations of
//! `RegisterCudaVmmRegion`, docs/protocol.md): every read is a `recvmsg`,
//! and descriptors that arrive are queued in arrival order, owned (closed
//! when dropped), for the request they came with to take.
//!
//! Invariants: the queue is bounded ([`config::PASSED_FDS_MAX`]); a read
//! whose control data was truncated (more descriptors than room) is an
//! error, so no descriptor is silently lost or misattributed; descriptors
//! are received close-on-exec.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::config;

pub struct FdSocket {
    stream: UnixStream,
    fds: VecDeque<OwnedFd>,
}

impl FdSocket {
    pub fn new(stream: UnixStream) -> FdSocket {
        FdSocket { stream, fds: VecDeque::new() }
    }

    /// Bounds each read (None: no bound), as [`UnixStream::set_read_timeout`].
    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        self.stream.set_read_timeout(t)
    }

    /// The oldest descriptor received and not yet taken.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }
}

/// Room for the control data of one recvmsg, in u64 words (the alignment
/// cmsg wants): at least CMSG_SPACE of [`config::FDS_PER_READ_MAX`] ints;
/// recvmsg is told exactly that much, so more is MSG_CTRUNC.
const CONTROL_WORDS: usize = 8;
const _: () = assert!(CONTROL_WORDS * 8 >= 16 + 4 * config::FDS_PER_READ_MAX);

fn control_bytes() -> usize {
    // SAFETY: CMSG_SPACE is arithmetic.
    let n = unsafe { libc::CMSG_SPACE((std::mem::size_of::<i32>() * config::FDS_PER_READ_MAX) as u32) } as usize;
    assert!(n <= CONTROL_WORDS * 8, "the control buffer holds FDS_PER_READ_MAX descriptors");
    n
}

impl Read for FdSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut control = [0u64; CONTROL_WORDS];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: msghdr is plain data; all-zero is valid before the fields are set.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control_bytes();
        let n = loop {
            // SAFETY: iov describes `buf`, msg_control `control`, both live
            // and writable for the call.
            let n = unsafe { libc::recvmsg(self.stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        };
        let mut received = Vec::new();
        // SAFETY: the kernel filled `control` up to msg_controllen; the CMSG
        // macros walk only headers inside it, and each SCM_RIGHTS payload
        // holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors, now ours.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let n_fds = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<i32>();
                    let data = libc::CMSG_DATA(c).cast::<i32>();
                    for i in 0..n_fds {
                        received.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::other(format!(
                "the client passed more than {} file descriptors at once",
                config::FDS_PER_READ_MAX
            )));
        }
        if self.fds.len() + received.len() > config::PASSED_FDS_MAX {
            return Err(io::Error::other(format!(
                "the client passed more than {} file descriptors not yet used by a request",
                config::PASSED_FDS_MAX
            )));
        }
        self.fds.extend(received);
        Ok(n)
    }
}
