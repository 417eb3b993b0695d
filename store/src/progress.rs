//! An image that is written while it is still being filled: the filler (a
//! host memcpy, a device-to-host copy, anything) declares the runs it fills
//! in staging order and marks each one done; the writer
//! ([`crate::io::drive_fed`], under [`crate::commit::Store::commit_fed`])
//! writes only bytes below the ready prefix, so the disk works on the early
//! chunks while later ones are still copied. The filler finishes with the
//! tensor checksums (which the index needs) or fails with a reason (the
//! commit then stops before its commit point and leaves nothing behind).
//!
//! Invariants:
//! - bytes below [`Progress::ready`]'s answer are final: their filler has
//!   marked them done (the mutex orders its stores before the writer's
//!   reads), and nothing writes them again while the image is held;
//! - a filler ends in exactly one outcome ([`Progress::finish`] or
//!   [`Progress::fail`]); a filler dropped without one (a panic) fails it,
//!   so a writer never waits forever.

use std::sync::{Condvar, Mutex, MutexGuard};

/// How far the filling of one image is.
pub struct Progress {
    /// Absolute staging offsets: run `i` covers `starts[i]..starts[i + 1]`
    /// (the last run up to `end`).
    starts: Vec<u64>,
    end: u64,
    state: Mutex<State>,
    changed: Condvar,
}

struct State {
    done: Vec<bool>,
    /// The first run not done yet.
    next: usize,
    outcome: Option<Result<Vec<u32>, String>>,
    /// The tensors' digests, when the filler computed them (incremental
    /// saves); set with a successful outcome.
    digests: Option<Vec<u128>>,
    /// The least offset a blocked writer waits for (u64::MAX: none waits):
    /// a run done below it wakes nobody, so a copy of many small runs
    /// does not wake the writer (and take a core from the copy) per run.
    wanted: u64,
}

impl Progress {
    /// An image ending at staging offset `end`, filled in runs starting at
    /// `starts` (ascending, below `end`). Bytes below the first run (headers,
    /// written before the fill starts) are ready at once.
    pub fn new(starts: Vec<u64>, end: u64) -> Progress {
        assert!(
            starts.windows(2).all(|w| w[0] <= w[1]) && starts.last().is_none_or(|&s| s <= end),
            "runs out of order"
        );
        let n = starts.len();
        Progress {
            starts,
            end,
            state: Mutex::new(State { done: vec![false; n], next: 0, outcome: None, digests: None, wanted: u64::MAX }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("progress lock poisoned")
    }

    fn prefix(&self, st: &State) -> u64 {
        self.starts.get(st.next).copied().unwrap_or(self.end)
    }

    /// Marks run `i` filled (its stores visible to other threads: a plain
    /// copy, or streaming stores followed by a fence).
    pub fn done(&self, i: usize) {
        let mut st = self.lock();
        st.done[i] = true;
        let before = st.next;
        while st.next < st.done.len() && st.done[st.next] {
            st.next += 1;
        }
        // Woken: every blocked writer; each sets `wanted` again if it still waits.
        let wake = st.next != before && self.prefix(&st) >= st.wanted;
        if wake {
            st.wanted = u64::MAX;
        }
        drop(st);
        if wake {
            self.changed.notify_all();
        }
    }

    /// The filler's end: every run done, these are the tensor checksums.
    pub fn finish(&self, crcs: Vec<u32>) {
        let mut st = self.lock();
        st.next = st.done.len();
        st.outcome.get_or_insert(Ok(crcs));
        drop(st);
        self.changed.notify_all();
    }

    /// [`Progress::finish`] with each tensor's digest ([`crate::digest`]).
    pub fn finish_with_digests(&self, crcs: Vec<u32>, digests: Vec<u128>) {
        let mut st = self.lock();
        st.next = st.done.len();
        if st.outcome.is_none() {
            st.outcome = Some(Ok(crcs));
            st.digests = Some(digests);
        }
        drop(st);
        self.changed.notify_all();
    }

    /// The digests the filler gave with its outcome (waits for it, as
    /// [`Progress::outcome`]); None when it gave none or failed.
    pub fn digests(&self) -> Option<Vec<u128>> {
        let _ = self.outcome();
        self.lock().digests.clone()
    }

    /// The filler's end: the image will never be complete, because `why`.
    pub fn fail(&self, why: String) {
        self.lock().outcome.get_or_insert(Err(why));
        self.changed.notify_all();
    }

    /// The end of the ready prefix (an absolute staging offset); with
    /// `block`, first waits until it reaches `need` or the filler ended.
    /// An error once the filler failed.
    pub fn ready(&self, need: u64, block: bool) -> Result<u64, String> {
        let mut st = self.lock();
        loop {
            if let Some(Err(why)) = &st.outcome {
                return Err(why.clone());
            }
            let p = self.prefix(&st);
            if !block || p >= need || st.outcome.is_some() {
                return Ok(p);
            }
            st.wanted = st.wanted.min(need);
            st = self.changed.wait(st).expect("progress lock poisoned");
        }
    }

    /// Waits for the filler's end: the tensor checksums, or why it failed.
    pub fn outcome(&self) -> Result<Vec<u32>, String> {
        let mut st = self.lock();
        loop {
            if let Some(o) = &st.outcome {
                return o.clone();
            }
            st = self.changed.wait(st).expect("progress lock poisoned");
        }
    }

    /// Whether the filler has ended (either way).
    pub fn ended(&self) -> bool {
        self.lock().outcome.is_some()
    }
}

/// The filler's side: fails the image if dropped before an outcome.
pub struct Filler<'a>(pub &'a Progress);

impl Drop for Filler<'_> {
    fn drop(&mut self) {
        self.0.fail("the copy ended without finishing".into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_prefix_grows_only_over_runs_done_in_order() {
        let p = Progress::new(vec![4096, 8192, 12288], 16384);
        assert_eq!(p.ready(0, false), Ok(4096));
        p.done(1);
        assert_eq!(p.ready(0, false), Ok(4096), "run 0 is not done: run 1 is not ready");
        p.done(0);
        assert_eq!(p.ready(0, false), Ok(12288));
        p.done(2);
        assert_eq!(p.ready(0, false), Ok(16384));
        p.finish(vec![7]);
        assert_eq!(p.outcome(), Ok(vec![7]));
    }

    #[test]
    fn runs_below_what_a_blocked_writer_needs_do_not_wake_it() {
        let p = Arc::new(Progress::new(vec![0, 100, 200, 300], 400));
        let q = p.clone();
        let h = std::thread::spawn(move || q.ready(300, true));
        // Wait until the writer blocks (it has said what it needs).
        while p.lock().wanted == u64::MAX {
            std::thread::yield_now();
        }
        p.done(0);
        p.done(1);
        assert_eq!(p.lock().wanted, 300, "runs below the need: the writer was not woken");
        assert!(!h.is_finished());
        p.done(2);
        assert_eq!(h.join().unwrap(), Ok(300));
        assert_eq!(p.lock().wanted, u64::MAX, "a woken writer that got what it needed waits no more");
    }

    #[test]
    fn a_blocked_writer_wakes_on_progress_and_on_failure() {
        let p = Arc::new(Progress::new(vec![0, 100], 200));
        let q = p.clone();
        let h = std::thread::spawn(move || q.ready(150, true));
        p.done(0);
        p.done(1);
        assert_eq!(h.join().unwrap(), Ok(200));
        let p = Arc::new(Progress::new(vec![0], 200));
        let q = p.clone();
        let h = std::thread::spawn(move || (q.ready(200, true), q.outcome()));
        drop(Filler(&p));
        let (r, o) = h.join().unwrap();
        assert!(r.unwrap_err().contains("without finishing"));
        assert!(o.is_err());
        assert!(p.ended());
    }
}
