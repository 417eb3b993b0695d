//! The scheduling of the sidecar's background threads, each call for the
//! calling thread only (and the threads it starts later, which inherit
//! it). A refusal by the kernel only costs the courtesy: nothing to do.
//!
//! - [`idle_cpu`]: the copy helpers (`save/helpers.rs`);
//! - [`idle_cpu_and_io`]: the drain;
//! - both of those and [`nice_19`]: the scrub;
//! - [`nice_19`] alone: replication to and from peers.

/// The SCHED_IDLE class: the thread runs only on a core nothing else
/// wants. The copy helpers use it so that a trainer blocked waiting for
/// Released lends them its core, while a trainer that computes (tensors
/// resident in shared memory, or the checksum pass after the release) is
/// never slowed by them.
pub fn idle_cpu() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: changes only the calling thread's scheduling policy (pid 0);
    // `param` is a valid sched_param for SCHED_IDLE.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
}

/// [`idle_cpu`], and the idle I/O class: where the disk's scheduler
/// honours classes (mq-deadline, bfq), the drain's reads and writes go
/// after the committer's, so a drain target on the same disk as `--dir`
/// does not slow the next save's writes (a loop that saves every step,
/// with a drain). mq-deadline still serves an idle request within its
/// aging time (`prio_aging_expire`, 10 s), so the drain is never starved
/// for good.
pub fn idle_cpu_and_io() {
    idle_cpu();
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_IDLE: libc::c_long = 3;
    const IOPRIO_CLASS_SHIFT: libc::c_long = 13;
    // SAFETY: sets the I/O priority of the calling thread only (who =
    // process, id 0 = the caller); no memory is passed. A kernel without
    // it returns an error, which leaves the default class.
    unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0 as libc::c_long,
            IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
        )
    };
}

/// Nice 19: the smallest share of the CPU among the normal threads, but a
/// share. Replication (the sender, and the receiver's copy and check of a
/// replica) uses it, not SCHED_IDLE: a peer waits on the other end of each
/// transfer and gives up after `--peer-timeout`, so a node whose cores are
/// all busy (data loaders) must still give replication some time, never
/// starve it; and the trainer and the saves come first (on a loop that
/// saves every step, replication's memory traffic otherwise slows the
/// trainer's step: docs/performance.md).
pub fn nice_19() {
    // SAFETY: gettid has no preconditions; setpriority changes only this
    // thread's nice value (PRIO_PROCESS with a thread id names one thread
    // on Linux) and takes no memory.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}
