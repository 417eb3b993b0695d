//! Writing frames to the sidecar's socket: whole frames, never with SIGPIPE
//! possible (`MSG_NOSIGNAL`: a dead sidecar must never kill the trainer),
//! checked against the protocol's frame limit before a byte goes, and
//! optionally carrying one descriptor (`SCM_RIGHTS`) on their first bytes.
//! Reading is the reply thread's ([`super::reply_thread`]).

use std::io;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;

use ckpt_wire::{Request, FRAME_BYTES_MAX};

use crate::error::{Error, Result};

/// Writes one frame without ever raising SIGPIPE.
pub(super) fn send_frame(stream: &UnixStream, msg: &Request) -> Result<()> {
    send_frame_with(stream, msg, None)
}

/// Writes one frame without ever raising SIGPIPE; with `fd`, its first
/// bytes carry that descriptor (SCM_RIGHTS: the sidecar gets its own).
pub(super) fn send_frame_with(stream: &UnixStream, msg: &Request, pass_fd: Option<i32>) -> Result<()> {
    send_encoded_with(stream, &ckpt_wire::encode(msg), pass_fd)
}

/// Writes one encoded frame (length prefix included) without ever raising SIGPIPE.
pub(super) fn send_encoded(stream: &UnixStream, frame: &[u8]) -> Result<()> {
    send_encoded_with(stream, frame, None)
}

/// [`send_encoded`], with `fd` passed as [`send_frame_with`] does.
fn send_encoded_with(stream: &UnixStream, frame: &[u8], mut pass_fd: Option<i32>) -> Result<()> {
    let body_bytes = frame.len() - 4;
    if body_bytes > FRAME_BYTES_MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "the request is {body_bytes} bytes encoded, above the protocol's frame limit of {FRAME_BYTES_MAX} bytes (fewer tensors or smaller blobs per save)"
        )));
    }
    let fd = stream.as_raw_fd();
    let mut off = 0;
    while off < frame.len() {
        let n = match pass_fd {
            Some(passed) => send_with_fd(fd, &frame[off..], passed),
            // SAFETY: the pointer and length describe the live `frame[off..]`.
            None => unsafe { libc::send(fd, frame[off..].as_ptr().cast(), frame.len() - off, libc::MSG_NOSIGNAL) },
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Disconnected { reason: format!("sending to the sidecar failed: {e}") });
        }
        off += n as usize;
        // Sent with the first bytes that went: never twice.
        pass_fd = None;
    }
    Ok(())
}

/// One sendmsg of `bytes` on socket `sock` with descriptor `passed` in an
/// SCM_RIGHTS control message; returns what sendmsg returns.
fn send_with_fd(sock: i32, bytes: &[u8], passed: i32) -> isize {
    // Room for one int, aligned as the kernel wants (u64 words).
    let mut control = [0u64; 4];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; all-zero is valid before the fields are set.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    assert!(msg.msg_controllen <= std::mem::size_of_val(&control));
    // SAFETY: msg_control points at `control`, large enough for one
    // header and one int (asserted); CMSG_FIRSTHDR is then non-null, and the
    // data pointer lies inside `control`. iov describes the live `bytes`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), passed);
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    }
}
