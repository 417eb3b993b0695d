//! The deadline of the trainer's stream waits on the sidecar's copies
//! ([`super::Client::stream_wait_copy`]): a sidecar that is alive but stuck
//! (SIGSTOPped, wedged in a driver call) neither answers nor closes the
//! connection, so without it the copy-done word ([`crate::done_word`])
//! would never rise and the trainer's stream would wait for ever (and a
//! later `cudaFree` or synchronize would block the trainer's CPU too).
//!
//! One watchdog thread per client (`ckpt-shim-watch`, started at its first
//! stream wait) holds the deadline of every save a stream waits on. When one
//! passes with the save neither released nor over, it shuts the connection
//! down first, so the sidecar, should it resume, sees its client gone and
//! aborts the copy (a copy not yet released is never committed once its
//! client left) rather than commit bytes the trainer may overwrite now;
//! then it marks the connection lost, which fails every save not yet over
//! with the reason and raises the word: the stream goes on, and so does
//! training (the next call reconnects).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::reply_thread::{is_final, Shared, State};

/// How long a stream may wait on a save's copy before the sidecar counts as
/// stuck, unless [`STREAM_WAIT_DEADLINE_ENV`] or
/// [`super::Client::set_stream_wait_deadline`] says otherwise. Generous:
/// the copy waits first for the trainer's own work queued before the save.
pub const STREAM_WAIT_DEADLINE_DEFAULT: Duration = Duration::from_secs(300);

/// The environment variable (milliseconds; 0: no deadline) read at connect.
pub const STREAM_WAIT_DEADLINE_ENV: &str = "CKPT_SIDECAR_STREAM_WAIT_DEADLINE_MS";

/// The deadline the environment asks for (the default when unset or not a
/// number; None for 0: no deadline).
pub(super) fn deadline_from_env() -> Option<Duration> {
    match std::env::var(STREAM_WAIT_DEADLINE_ENV).ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(0) => None,
        Some(ms) => Some(Duration::from_millis(ms)),
        None => Some(STREAM_WAIT_DEADLINE_DEFAULT),
    }
}

/// Save `save_id` has a stream waiting on its copy from now: arms its
/// deadline (if the client has one), starting the watchdog at the first.
pub(super) fn arm(shared: &Arc<Shared>, st: &mut State, save_id: u64) {
    let Some(d) = st.stream_wait_deadline else { return };
    st.stream_deadlines.push((save_id, Instant::now() + d));
    if !st.watchdog_running {
        let s = shared.clone();
        // A refused thread leaves the deadline unwatched: the stream then
        // waits as it did without one (the connection's end still frees it).
        st.watchdog_running =
            std::thread::Builder::new().name("ckpt-shim-watch".into()).spawn(move || watch(&s)).is_ok();
    }
    shared.changed.notify_all();
}

/// The watchdog's body: until the client closes, fails the connection when
/// a stream wait's deadline passes with its save still unreleased.
fn watch(shared: &Shared) {
    let mut st = shared.state.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if st.closed {
            st.watchdog_running = false;
            return;
        }
        let State { stream_deadlines, saves, .. } = &mut *st;
        stream_deadlines
            .retain(|(id, _)| saves.get(id).is_some_and(|e| !e.status.released && !is_final(e.status.state)));
        let next = stream_deadlines.iter().min_by_key(|(_, at)| *at).copied();
        match next {
            None => st = shared.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
            Some((_, at)) if at > Instant::now() => {
                st = shared.changed.wait_timeout(st, at - Instant::now()).unwrap_or_else(|p| p.into_inner()).0;
            }
            Some((id, _)) => {
                expire(&mut st, id);
                shared.changed.notify_all();
            }
        }
    }
}

/// Save `id`'s stream wait ran past its deadline: the connection is shut
/// down (the sidecar must see its client gone before the trainer's stream
/// may go on), then lost, failing every open save and raising the word.
fn expire(st: &mut State, id: u64) {
    let what = st.saves.get(&id).map(|e| e.status.what()).unwrap_or_else(|| format!("save {id}"));
    let ms = st.stream_wait_deadline.map(|d| d.as_millis()).unwrap_or(0);
    if let Some(s) = &st.socket {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    st.stream_deadlines.clear();
    st.lose(format!(
        "the sidecar did not release the save of {what} within {ms} ms of the trainer's CUDA stream starting to wait on its copy \
         ({STREAM_WAIT_DEADLINE_ENV}): it is alive but not answering (stopped or wedged); this client dropped the connection, \
         so the sidecar, should it resume, aborts that copy instead of committing bytes the trainer may overwrite now"
    ));
}
