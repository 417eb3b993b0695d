//! Clients waiting for a step to be replicated (WaitReplicated): each
//! waiter is answered exactly once, Replicated or an error naming why not
//! (skipped, never to be drained, not committed here), through the
//! [`Answer`] its session gave; waiters are bounded
//! ([`config::DRAIN_WAITERS_MAX`]), and one whose client is gone is dropped
//! unanswered.

use std::sync::Arc;

use ckpt_wire::{ErrorCode, Reply};

use super::{Drain, State};
use crate::config;

/// Where the drain answers a client that waits for a step to be replicated
/// (a session's reply side, `crate::state::reply::Replies`): the drain knows
/// no sessions, only this.
pub trait Answer: Send + Sync {
    /// Sends one reply; false if it could not be sent.
    fn send(&self, reply: &Reply) -> bool;
    /// Whether the client has gone: its wait is dropped unanswered.
    fn is_gone(&self) -> bool;
}

/// One client waiting for a step to be replicated.
pub(super) struct Waiter {
    replies: Arc<dyn Answer>,
    id: u64,
    step: u64,
}

impl Drain {
    /// Answers every waiter whose step is replicated, skipped or never to
    /// be drained; drops those whose client is gone.
    pub(super) fn answer(&self, st: &mut State) {
        let url = self.url().to_string();
        let uploading = st.uploading;
        let done_upto = st.done_upto;
        let replicated = &st.replicated;
        let skipped = &st.skipped;
        let deleted = &st.deleted_undrained;
        let damaged = &st.damaged;
        st.waiters.retain(|w| {
            if w.replies.is_gone() {
                return false;
            }
            let reply = if replicated.contains(&w.step) {
                Some(Reply::Replicated { id: w.id, step: w.step, url: url.clone() })
            } else if let Some(why) = damaged.get(&w.step) {
                Some(Reply::Error { id: w.id, code: ErrorCode::Damaged, message: format!("step {}: damaged on this node ({why}); it is not replicated to {url}", w.step) })
            } else if skipped.contains(&w.step) || deleted.contains(&w.step) || (done_upto.is_some_and(|d| w.step <= d) && uploading != Some(w.step)) {
                Some(Reply::Error { id: w.id, code: ErrorCode::NotFound, message: format!("step {}: skipped by the drain to {url} (a newer step was drained instead, or it was deleted first); it is not replicated", w.step) })
            } else {
                None
            };
            match reply {
                Some(r) => {
                    w.replies.send(&r);
                    false
                }
                None => true,
            }
        });
    }

    /// A WaitReplicated: answered now, or when the step is replicated (or skipped).
    pub fn wait(&self, replies: Arc<dyn Answer>, id: u64, step: u64, committed_locally: bool) {
        let mut st = self.lock();
        if st.replicated.contains(&step) {
            replies.send(&Reply::Replicated { id, step, url: self.url().to_string() });
            return;
        }
        let refuse = |why: String| {
            replies.send(&Reply::Error {
                id,
                code: ErrorCode::NotFound,
                message: format!("step {step}: {why}; it will not be replicated to {}", self.url()),
            })
        };
        if step % self.opts.every != 0 {
            refuse(format!("--drain-every {} drains multiples of {} only", self.opts.every, self.opts.every));
            return;
        }
        if !committed_locally && st.uploading != Some(step) {
            refuse("not committed in this sidecar's directories".into());
            return;
        }
        if st.waiters.len() >= config::DRAIN_WAITERS_MAX {
            replies.send(&Reply::Error {
                id,
                code: ErrorCode::BadRequest,
                message: format!("more than {} waits for replication at once", config::DRAIN_WAITERS_MAX),
            });
            return;
        }
        st.waiters.push(Waiter { replies, id, step });
        self.answer(&mut st);
        drop(st);
        self.cv.notify_all();
    }
}
