//! Faults injected into an engine's completions, for tests: a chosen write
//! fails, or every write is cut short so the driver's resubmission runs for
//! real.

use std::io;
use std::sync::Arc;

use super::{Completion, IoEngine, Op, OpKind};
use crate::config::DIRECT_ALIGN_BYTES;
use crate::mem::RawBuf;

/// Faults to inject into an engine's completions, for tests: the n-th write
/// (0-based, counted per engine) fails with `errno`, and/or every write is cut
/// to a fraction of its length so the driver's short-write path runs for
/// real (the kernel only writes the shortened request).
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    pub fail_write_n: Option<(u64, i32)>,
    pub short_writes: bool,
}

pub struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    plan: FaultPlan,
    n_writes: u64,
    /// user_data of writes to fail on completion.
    doomed: Vec<u64>,
}

impl FaultyEngine {
    pub fn new(inner: Box<dyn IoEngine>, plan: FaultPlan) -> FaultyEngine {
        FaultyEngine { inner, plan, n_writes: 0, doomed: Vec::new() }
    }
}

impl IoEngine for FaultyEngine {
    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    unsafe fn push(&mut self, mut op: Op) -> io::Result<()> {
        if op.kind == OpKind::Write {
            if let Some((n, _)) = self.plan.fail_write_n {
                if self.n_writes == n {
                    self.doomed.push(op.user_data);
                }
            }
            self.n_writes += 1;
            // Cut writes of more than one block to half (block-aligned), so the
            // kernel really writes less and the driver must resubmit the rest.
            if self.plan.short_writes && op.len as usize > DIRECT_ALIGN_BYTES {
                op.len = ((op.len as usize / 2) & !(DIRECT_ALIGN_BYTES - 1)).max(DIRECT_ALIGN_BYTES) as u32;
            }
        }
        // SAFETY: forwarded contract; a shortened request covers a sub-range.
        unsafe { self.inner.push(op) }
    }

    fn submit(&mut self) -> io::Result<()> {
        self.inner.submit()
    }

    fn wait(&mut self, min: usize, out: &mut Vec<Completion>) -> io::Result<()> {
        let start = out.len();
        self.inner.wait(min, out)?;
        if let Some((_, errno)) = self.plan.fail_write_n {
            for c in &mut out[start..] {
                if let Some(i) = self.doomed.iter().position(|&u| u == c.user_data) {
                    self.doomed.swap_remove(i);
                    c.result = -errno;
                }
            }
        }
        Ok(())
    }

    fn register(&mut self, buf: Arc<RawBuf>) -> io::Result<()> {
        self.inner.register(buf)
    }
}
