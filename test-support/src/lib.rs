//! What the integration tests of the workspace's crates share: a seeded
//! PRNG whose seed comes from an environment variable (so a failing run
//! replays), and stopping a child process the way the daemon is stopped
//! (SIGTERM, drain); where the sidecar binary is (`bin`), its command line
//! run to the end (`cli`), the daemon's own harness (`daemon`: the real
//! binary, a raw wire client, shared-memory segments), and an S3 server
//! (`s3`). A dev-dependency only; nothing here ships.

pub mod bin;
pub mod cli;
pub mod daemon;
pub mod s3;

pub use bin::{sidecar_bin, sidecar_bin_if_built};
pub use cli::{cli, CliRun};

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// xorshift64*: deterministic, no dependencies.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// The seed in `$var` (decimal or 0x-hex), else `default`; says on stderr
/// how to replay the run.
pub fn seed_from_env(var: &str, default: u64, test: &str) -> u64 {
    let s = match std::env::var(var) {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("{var}={v:?}: expected a decimal or 0x-hex u64"))
        }
        Err(_) => default,
    };
    eprintln!("{test}: seed {s:#x} (replay with {var}={s:#x})");
    s
}

/// SIGKILLs a child not yet reaped, and reaps it.
pub fn kill9(child: &mut Child) -> ExitStatus {
    // SAFETY: signalling our own child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    child.wait().expect("reaping a child")
}

/// SIGTERM (the daemon drains and exits), then its exit code (-1 when a
/// signal ended it); None when it was still running after `patience`, in
/// which case it is SIGKILLed and reaped.
pub fn terminate(child: &mut Child, patience: Duration) -> Option<i32> {
    // SAFETY: signalling our own child, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("polling a child") {
            return Some(st.code().unwrap_or(-1));
        }
        if t0.elapsed() > patience {
            kill9(child);
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
