//! The background scrub (`serve --scrub-interval DURATION`): every interval,
//! a pass that re-verifies each committed step on disk, every byte (the
//! engine's streaming verify), one step at a time, oldest first, so damage
//! is found before a restore needs the step.
//!
//! Invariants: the scrub never competes with the trainer's saves and loads:
//! its thread (and the reader threads it starts, which inherit it) runs at
//! SCHED_IDLE, nice 19 and the idle I/O class, reads through the thread
//! pool engine (io_uring's kernel workers would not inherit the class), and
//! keeps to [`config::SCRUB_BYTES_PER_S_MAX`]. It changes no checkpoint
//! byte: a damaged step gets a mark (`catalog::mark_damaged`, crash-safe)
//! that loads honour, and a damage record for `status` and the metrics
//! (`crate::state::damage`). A step retention deleted under a pass is
//! passed over, not reported.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ckpt_store::catalog;
use ckpt_store::io::Want;
use ckpt_store::restore::{LoadError, ReadOptions, Verifier};
use ckpt_wire::ScrubReport;
use tracing::{info, warn};

use crate::config;
use crate::state::damage::{self, Finder};
use crate::state::DaemonState;

/// The scrub's thread and its progress (for `status` and the metrics).
pub struct Scrub {
    interval: Duration,
    report: Mutex<ScrubReport>,
}

/// Starts the scrub's thread for `state`'s directories, a pass every
/// `interval` (the first one interval after the start).
pub fn spawn(state: Arc<DaemonState>, interval: Duration) -> std::io::Result<Arc<Scrub>> {
    let scrub = Arc::new(Scrub {
        interval,
        report: Mutex::new(ScrubReport { interval_s: interval.as_secs_f64(), ..ScrubReport::default() }),
    });
    let s = scrub.clone();
    let reported = scrub.clone();
    let _ = state.scrub.set(Box::new(move || reported.report()));
    std::thread::Builder::new().name("ckpt-scrub".into()).spawn(move || {
        // CPU and disk time nothing else wants.
        crate::priority::idle_cpu_and_io();
        crate::priority::nice_19();
        s.run(&state);
    })?;
    Ok(scrub)
}

fn now_unix_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Scrub {
    pub fn report(&self) -> ScrubReport {
        self.report.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn update(&self, f: impl FnOnce(&mut ScrubReport)) {
        f(&mut self.report.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn run(&self, state: &DaemonState) {
        let mut verifier = Verifier::default();
        let mut next = Instant::now() + self.interval;
        loop {
            if !sleep_until(state, next) {
                return;
            }
            next = Instant::now() + self.interval;
            if !self.pass(state, &mut verifier) {
                return;
            }
            self.update(|r| {
                r.passes += 1;
                r.last_pass_unix_s = Some(now_unix_s());
            });
        }
    }

    /// One pass over the committed steps, oldest first; false when the
    /// daemon stops meanwhile.
    fn pass(&self, state: &DaemonState, verifier: &mut Verifier) -> bool {
        let primary = state.read_dir();
        let steps = catalog::readable_steps(primary).unwrap_or_default();
        let opts = ReadOptions {
            io: ckpt_store::io::IoPolicy { uring: Want::Off, ..state.read_opts.io },
            ..state.read_opts.clone()
        };
        for step in steps {
            if stopping(state) {
                return false;
            }
            if catalog::damage_mark(primary, step).is_some() {
                continue; // reported when it was marked
            }
            self.update(|r| r.verifying = Some(step));
            let t0 = Instant::now();
            let mut stopped = false;
            let r = verifier.verify(primary, step, &opts, |done, _| {
                // Keep to the bandwidth: wait until `done` bytes are due.
                let due = Duration::from_secs_f64(done as f64 / config::SCRUB_BYTES_PER_S_MAX as f64);
                stopped = stopped || !sleep_until(state, t0 + due);
            });
            self.update(|r| r.verifying = None);
            if stopped {
                return false;
            }
            match r {
                Ok(v) if v.problems.is_empty() => self.update(|r| {
                    r.steps_verified += 1;
                    r.bytes_verified += v.bytes;
                }),
                // Deleted under the pass (retention, a rollback): not damage.
                _ if !catalog::is_readable(primary, step) => {}
                Ok(v) => {
                    self.update(|r| {
                        r.steps_verified += 1;
                        r.bytes_verified += v.bytes;
                    });
                    let why = v.problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
                    warn!(step, "scrub: committed step damaged: {why}; marked, loads pass over it");
                    // The mark first: once status shows the damage, loads pass over the step.
                    if let Err(e) = catalog::mark_damaged(primary, step, &format!("found by the scrub: {why}")) {
                        warn!(step, "scrub: marking the damaged step failed ({e}); it is only reported");
                    }
                    damage::record_problems(step, &v.problems, Finder::Scrub);
                }
                Err(e @ LoadError::Damaged { .. }) => {
                    warn!(step, "scrub: committed step damaged: {e}");
                    damage::record_load_error(&e, Finder::Scrub);
                }
                Err(e) => warn!(step, "scrub: verifying the step failed ({e}); tried again next pass"),
            }
            info!(step, seconds = t0.elapsed().as_secs_f64(), "scrub: step verified");
        }
        match &state.drain {
            Some(d) => self.pass_remote(state, d),
            None => true,
        }
    }

    /// The drain target's steps, verified as the local ones (reported, not
    /// marked: the target is written by the drain alone); false when the
    /// daemon stops meanwhile.
    fn pass_remote(&self, state: &DaemonState, d: &crate::drain::Drain) -> bool {
        use crate::drain::RemoteVerify;
        let Some(steps) = d.remote_steps() else {
            warn!(url = d.url(), "scrub: listing the drain target failed; tried again next pass");
            return true;
        };
        for step in steps {
            if stopping(state) {
                return false;
            }
            let t0 = Instant::now();
            let mut stopped = false;
            let r = d.verify_remote(step, config::REMOTE_VERIFY_WINDOW_BYTES, |done, _| {
                let due = Duration::from_secs_f64(done as f64 / config::SCRUB_BYTES_PER_S_MAX as f64);
                stopped = stopped || !sleep_until(state, t0 + due);
            });
            if stopped {
                return false;
            }
            match r {
                RemoteVerify::Verified(v) => {
                    self.update(|r| {
                        r.remote_steps_verified += 1;
                        r.remote_bytes_verified += v.bytes;
                    });
                    if !v.problems.is_empty() {
                        let why = v.problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
                        warn!(step, url = d.url(), "scrub: the drain target's copy of the step is damaged: {why}");
                        damage::record_problems(step, &v.problems, Finder::ScrubDrain);
                    }
                }
                RemoteVerify::Gone => {}
                RemoteVerify::Failed(e) => {
                    warn!(
                        step,
                        url = d.url(),
                        "scrub: verifying the drain target's step failed ({e}); tried again next pass"
                    )
                }
            }
        }
        true
    }
}

fn stopping(state: &DaemonState) -> bool {
    state.is_draining() || state.is_aborting()
}

/// Sleeps until `deadline`, waking every [`config::SCRUB_WAKE_MS`] to see
/// whether the daemon stops; false when it does.
fn sleep_until(state: &DaemonState, deadline: Instant) -> bool {
    loop {
        if stopping(state) {
            return false;
        }
        let now = Instant::now();
        if now >= deadline {
            return true;
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(config::SCRUB_WAKE_MS)));
    }
}
