//! The copy helpers: threads kept for the process's life that lend a copy
//! or checksum pass ([`crate::save::pieces::run_runs`]) the other cores.
//!
//! Kept, not spawned per pass: a thread spawned starts on its parent's
//! core, queued behind the very copy it should share, until the scheduler
//! moves it. On the 2-core VM a helper spawned for the copy of a 4 MiB
//! save started after the whole copy was done (perf: it copied nothing, the
//! session thread everything). A kept thread woken from its channel is
//! placed on an idle core at once.
//!
//! Invariants:
//! - a task's work is run only while its caller is inside [`lend`]: the
//!   caller withdraws a task no helper has started, and waits for one that
//!   has, before `lend` returns or unwinds, so the work's borrows outlive
//!   every use;
//! - a caller never waits for a helper to become free: a task still
//!   queued behind another pass when the caller's own share of the work is
//!   done is withdrawn, not waited for.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::config;

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Queued,
    Running,
    /// Ended; true when the work panicked.
    Done(bool),
    Withdrawn,
}

/// A task's state, shared by its caller and the helper that takes it.
struct Slot {
    state: Mutex<State>,
    ended: Condvar,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a plain value: a panic elsewhere leaves it valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The work as its caller lent it, its lifetime erased (see the module's
/// invariants for why it is alive whenever it is called).
struct Task {
    slot: Arc<Slot>,
    work: *const (dyn Fn() + Sync + 'static),
}

// SAFETY: the work is Sync (called from any thread) and alive while its
// task can still start (the module's invariants); the slot is Send + Sync.
unsafe impl Send for Task {}

impl Task {
    fn run(self) {
        {
            let mut s = self.slot.lock();
            if *s != State::Queued {
                return;
            }
            *s = State::Running;
        }
        // SAFETY: Running: the caller waits in `lend` until this task is
        // Done, so the work it borrows is alive for the whole call.
        let panicked = catch_unwind(AssertUnwindSafe(|| unsafe { (*self.work)() })).is_err();
        *self.slot.lock() = State::Done(panicked);
        self.slot.ended.notify_all();
    }
}

/// What a helper is sent.
enum Msg {
    Task(Task),
    /// A pass is coming: wait for it awake ([`warm`]).
    Warm,
}

/// How long a helper told [`warm`] waits awake for a task before it
/// sleeps again: longer than a save's planning and checks, short beside
/// the time between two saves.
const WARM_FOR: Duration = Duration::from_millis(2);

/// The helpers' queue, started at first use: [`config::COPY_THREADS`] − 1
/// threads, each at idle priority for its life.
fn queue() -> Option<&'static Sender<Msg>> {
    static QUEUE: OnceLock<Option<Sender<Msg>>> = OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = crossbeam_channel::unbounded::<Msg>();
            let mut started = 0;
            for i in 1..config::COPY_THREADS {
                let rx = rx.clone();
                let spawned = std::thread::Builder::new().name(format!("ckpt-copy-{i}")).spawn(move || {
                    crate::priority::idle_cpu();
                    while let Ok(msg) = rx.recv() {
                        match msg {
                            Msg::Task(task) => task.run(),
                            Msg::Warm => wait_awake(&rx),
                        }
                    }
                });
                started += usize::from(spawned.is_ok());
            }
            // No helper could start (threads refused): every pass runs on
            // its caller alone.
            (started > 0).then_some(tx)
        })
        .as_ref()
}

/// Tells the helpers a pass is coming (a save received, to be planned and
/// copied): each free one waits for it awake, for at most [`WARM_FOR`],
/// instead of being woken by it. A sleeping core of a virtual machine takes
/// about as long to wake as the copy of a few MiB takes (measured on the
/// 2-core VM, saves of 4 MiB: a helper woken by the pass itself took no run
/// in 25 of 48 copy and digest passes); the save's planning and checks hide
/// the wake.
pub fn warm() {
    if let Some(queue) = queue() {
        for _ in 1..config::COPY_THREADS {
            let _ = queue.send(Msg::Warm);
        }
    }
}

/// A warmed helper's wait: runs the first task that comes within
/// [`WARM_FOR`], spinning (at idle priority: any other thread of the core
/// goes first), then returns to sleep.
fn wait_awake(rx: &crossbeam_channel::Receiver<Msg>) {
    let until = Instant::now() + WARM_FOR;
    loop {
        match rx.try_recv() {
            Ok(Msg::Task(task)) => return task.run(),
            Ok(Msg::Warm) => {}
            Err(crossbeam_channel::TryRecvError::Disconnected) => return,
            Err(crossbeam_channel::TryRecvError::Empty) => {
                if Instant::now() >= until {
                    return;
                }
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// Runs `main` on this thread while up to `helpers` (at most
/// [`config::COPY_THREADS`] − 1) kept threads that are free run `work` too;
/// returns `main`'s result once no helper runs `work` any more. `work`
/// must end soon once `main` has ended (it shares `main`'s work and stops
/// when there is none left). Panics when `work` panicked on a helper, as a
/// joined thread's panic did.
pub(super) fn lend<R>(helpers: usize, work: &(dyn Fn() + Sync), main: impl FnOnce() -> R) -> R {
    /// Withdraws or waits for every task when `lend` returns or unwinds.
    struct Lent(Vec<Arc<Slot>>);
    impl Lent {
        /// Whether a helper's work panicked.
        fn end(&mut self) -> bool {
            let mut panicked = false;
            for slot in self.0.drain(..) {
                let mut s = slot.lock();
                if *s == State::Queued {
                    *s = State::Withdrawn;
                    continue;
                }
                while *s == State::Running {
                    s = slot.ended.wait(s).unwrap_or_else(|e| e.into_inner());
                }
                panicked |= *s == State::Done(true);
            }
            panicked
        }
    }
    impl Drop for Lent {
        fn drop(&mut self) {
            self.end();
        }
    }
    // SAFETY: only the lifetime changes; `Lent` ends every task before the
    // borrow ends (the module's invariants).
    let erased: *const (dyn Fn() + Sync + 'static) =
        unsafe { std::mem::transmute::<*const (dyn Fn() + Sync + '_), _>(work as *const _) };
    let mut lent = Lent(Vec::new());
    if let Some(queue) = queue() {
        for _ in 0..helpers.min(config::COPY_THREADS - 1) {
            let slot = Arc::new(Slot { state: Mutex::new(State::Queued), ended: Condvar::new() });
            if queue.send(Msg::Task(Task { slot: slot.clone(), work: erased })).is_ok() {
                lent.0.push(slot);
            }
        }
    }
    let out = main();
    assert!(!lent.end(), "copy thread panicked");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn helpers_share_the_work_and_are_done_with_it_when_lend_returns() {
        for _ in 0..200 {
            let next = AtomicUsize::new(0);
            let sum = AtomicUsize::new(0);
            let work = || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= 1000 {
                    return;
                }
                sum.fetch_add(i, Ordering::Relaxed);
            };
            lend(1, &work, work);
            // Every item taken once, and no helper still adding.
            assert_eq!(sum.load(Ordering::Relaxed), 999 * 1000 / 2);
        }
    }

    #[test]
    fn a_busy_helper_is_not_waited_for() {
        // One pass holds every helper until told to end; another pass lends
        // meanwhile, finds no helper free, and returns on its own work.
        let release = std::sync::Barrier::new(2);
        let busy = AtomicUsize::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                let hold = || {
                    busy.fetch_add(1, Ordering::SeqCst);
                    release.wait();
                };
                lend(1, &hold, || {
                    // Wait until the helper runs `hold` (bounded: a hang fails the test run, not a clock).
                    while busy.load(Ordering::SeqCst) == 0 {
                        std::thread::yield_now();
                    }
                });
            });
            while busy.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
            let ran = AtomicUsize::new(0);
            let count = || {
                ran.fetch_add(1, Ordering::SeqCst);
            };
            assert_eq!(lend(1, &count, || 7), 7);
            // Withdrawn before any helper took it.
            assert_eq!(ran.load(Ordering::SeqCst), 0);
            release.wait();
        });
    }

    #[test]
    #[should_panic(expected = "copy thread panicked")]
    fn a_panic_on_a_helper_reaches_the_caller() {
        let started = AtomicUsize::new(0);
        let work = || {
            started.fetch_add(1, Ordering::SeqCst);
            panic!("in the work");
        };
        lend(1, &work, || {
            while started.load(Ordering::SeqCst) == 0 {
                std::thread::yield_now();
            }
        });
    }
}
