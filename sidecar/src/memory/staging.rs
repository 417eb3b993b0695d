//! The daemon's staging memory: one pre-faulted, page-aligned buffer of the
//! staging budget, allocated once at start and registered with every
//! io_uring, carved into leases by a first-fit range allocator.
//!
//! A save leases the bytes of its file image, the snapshot copies into the
//! lease, the committer writes from it, and a committed image stays resident
//! (for RAM restores) until its space is needed. A save that fits the budget
//! but not the free space waits (back-pressure, logged); one larger than the
//! budget fails at once. A disk load borrows a lease the same way.
//!
//! Invariants:
//! - leases are disjoint, block-aligned ranges of the buffer; only the
//!   holder of a lease creates references into its range, and only while no
//!   copy fills it ([`Lease::as_slice`] and [`Lease::as_mut_slice`] assert
//!   that its filler ended), so concurrent copies into one lease and writes
//!   to disk from another are sound;
//! - nothing creates a reference to the whole buffer, by type: it is a
//!   [`RawBuf`] (an address and a length, no slice), and what
//!   [`Staging::buf`] and [`Lease::staging_buf`] hand out (for registration,
//!   `Store::commit` and the like) is that, so only `unsafe` code reads or
//!   writes it outside a lease's slices;
//! - the resident image is given up before any save waits for space, and
//!   so is an image lent to the drain (a save waits at most for the drain's
//!   parts in progress, never for its upload).

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::config::{self, STAGING_ALIGN_BYTES};
use ckpt_store::image::Layout;
use ckpt_store::mem::RawBuf;
use ckpt_store::progress::Progress;

#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    #[error(
        "needs {need_bytes} bytes of staging, but the whole staging budget is {budget_bytes} bytes (raise --staging)"
    )]
    TooLarge { need_bytes: u64, budget_bytes: u64 },
    #[error("gave up waiting for staging memory: {why}")]
    GaveUp { why: &'static str },
    #[error("cannot allocate {} of staging memory (--staging {budget_bytes}): {source}; pass a smaller --staging", ckpt_store::units::human_bytes(*.budget_bytes))]
    Alloc { budget_bytes: u64, source: std::io::Error },
}

/// A checkpoint committed from staging and still there, so a load of its
/// step is served from memory.
pub struct Resident {
    pub step: u64,
    /// Planned at base 0: offsets are relative to the lease.
    pub layout: Layout,
    pub crcs: Vec<u32>,
    /// Each tensor's digest (an incremental layout's; None otherwise).
    pub digests: Option<Vec<u128>>,
    pub blobs: Vec<ckpt_wire::Blob>,
    pub lease: Lease,
    /// The session that saved it, opaque to staging: a save's tensors flagged
    /// unchanged since this step are taken from here only for that session
    /// (`crate::save::trusted_unchanged`). A Weak keeps the pointer from being reused.
    pub origin: Origin,
}

/// Who saved a resident image: compared by address only
/// (`std::sync::Weak::ptr_eq`), never upgraded. An empty Weak is nobody's.
pub type Origin = std::sync::Weak<dyn std::any::Any + Send + Sync>;

struct State {
    /// Free extents: offset → length, coalesced, block-aligned.
    free: BTreeMap<u64, u64>,
    used_bytes: u64,
    resident: Option<Arc<Resident>>,
    /// The resident image lent to the drain ([`Staging::lend_resident`]).
    lent: Option<Arc<Lent>>,
    /// How many times a save took a lent image back.
    lends_taken_back: u64,
}

/// A committed image lent to the drain, which uploads from it instead of
/// reading the step back from disk. A save never waits for the drain's
/// upload: one that needs the image's space, or the image itself (adopt),
/// takes it back ([`Lent::take_back`]), waiting only for the reads in
/// progress (the parts being written to the target at that moment); the
/// drain reads the rest from disk.
pub struct Lent {
    step: u64,
    image: std::sync::RwLock<Option<Arc<Resident>>>,
}

impl Lent {
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Runs `f` over the image while it is lent; None once taken back.
    pub fn with<R>(&self, f: impl FnOnce(&Resident) -> R) -> Option<R> {
        let g = self.image.read().expect("lent image lock");
        g.as_ref().map(|r| f(r))
    }

    /// Ends the loan: waits for the reads in progress, then lets the image
    /// go (its lease is freed here if no one else holds it). Never called
    /// under the staging lock (freeing a lease takes it).
    pub fn take_back(&self) {
        let image = self.image.write().expect("lent image lock").take();
        drop(image);
    }

    /// [`Lent::take_back`] unless a read is in progress: false then (the
    /// loan goes on).
    pub fn try_take_back(&self) -> bool {
        match self.image.try_write() {
            Ok(mut g) => {
                drop(g.take());
                true
            }
            Err(_) => false,
        }
    }

    pub fn is_lent(&self) -> bool {
        self.image.read().expect("lent image lock").is_some()
    }
}

pub struct Staging {
    buf: Arc<RawBuf>,
    budget_bytes: u64,
    state: Mutex<State>,
    freed: Condvar,
}

impl Staging {
    /// Allocates and pre-faults the whole budget (rounded down to the
    /// block), and tries to lock it in RAM.
    pub fn new(budget_bytes: u64) -> Result<Arc<Staging>, StagingError> {
        let budget_bytes = budget_bytes / STAGING_ALIGN_BYTES as u64 * STAGING_ALIGN_BYTES as u64;
        assert!(budget_bytes >= config::STAGING_BYTES_MIN, "staging budget below the minimum (checked by the caller)");
        let t0 = Instant::now();
        let buf = RawBuf::new(budget_bytes as usize).map_err(|source| StagingError::Alloc { budget_bytes, source })?;
        let locked = buf.try_lock();
        info!(budget_bytes, locked, seconds = t0.elapsed().as_secs_f64(), "staging memory allocated and pre-faulted");
        let mut free = BTreeMap::new();
        free.insert(0, budget_bytes);
        Ok(Arc::new(Staging {
            buf: Arc::new(buf),
            budget_bytes,
            state: Mutex::new(State { free, used_bytes: 0, resident: None, lent: None, lends_taken_back: 0 }),
            freed: Condvar::new(),
        }))
    }

    /// The buffer, for registration with the I/O engines and CUDA: its
    /// address and length only.
    pub fn buf(&self) -> &Arc<RawBuf> {
        &self.buf
    }

    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("staging lock poisoned")
    }

    /// Bytes leased now (the resident image included).
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes
    }

    pub fn resident(&self) -> Option<Arc<Resident>> {
        self.lock().resident.clone()
    }

    pub fn resident_step(&self) -> Option<u64> {
        self.lock().resident.as_ref().map(|r| r.step)
    }

    /// Takes the resident image out of staging, lease and all, when no one
    /// else holds it (no load reads it now) and `f` accepts it (returning
    /// what it found): a save then lays its image over it in place
    /// (`crate::save::trusted_unchanged::adopt`). The resident stays when `f` says None.
    pub fn take_resident_with<T>(&self, f: impl FnOnce(&Resident) -> Option<T>) -> Option<(Resident, T)> {
        let mut st = self.lock();
        // A save comes before the drain: an image lent to it is taken back,
        // but only when no part is being read from it right now. This runs
        // in a save's snapshot (the trainer waits for it), and a part in
        // progress may take long at the drain's idle I/O priority: then
        // nothing is adopted and the save copies, as without a resident.
        if st.resident.as_ref().is_some_and(|r| Arc::strong_count(r) != 1) {
            if let Some(l) = st.lent.clone() {
                drop(st);
                if !l.try_take_back() {
                    return None;
                }
                info!(
                    step = l.step,
                    "staging: the image lent to the drain taken back for a save (the drain reads the rest from disk)"
                );
                st = self.lock();
                if st.lent.as_ref().is_some_and(|x| Arc::ptr_eq(x, &l)) {
                    st.lent = None;
                }
                st.lends_taken_back += 1;
            }
        }
        let r = st.resident.as_ref()?;
        // Clones are made only under this lock (`resident`): a count of one
        // now stays one, so the unwrap below cannot fail.
        if Arc::strong_count(r) != 1 {
            return None;
        }
        let t = f(r)?;
        let r = Arc::try_unwrap(st.resident.take().expect("checked above"))
            .ok()
            .expect("the only reference, under the lock");
        Some((r, t))
    }

    /// Lends the resident image to the drain when it is `step`'s, until
    /// [`Staging::end_lend`] or a save takes it back. One loan at a time (a
    /// former one is ended).
    pub fn lend_resident(&self, step: u64) -> Option<Arc<Lent>> {
        let mut st = self.lock();
        let old = st.lent.take();
        let lent = st
            .resident
            .as_ref()
            .filter(|r| r.step == step)
            .map(|r| Arc::new(Lent { step, image: std::sync::RwLock::new(Some(r.clone())) }));
        st.lent = lent.clone();
        drop(st);
        if let Some(o) = old {
            o.take_back();
        }
        lent
    }

    /// The drain is done with `lent`.
    pub fn end_lend(&self, lent: &Arc<Lent>) {
        let mut st = self.lock();
        if st.lent.as_ref().is_some_and(|l| Arc::ptr_eq(l, lent)) {
            st.lent = None;
        }
        drop(st);
        lent.take_back();
    }

    /// How many times a save took an image lent to the drain back.
    pub fn lends_taken_back(&self) -> u64 {
        self.lock().lends_taken_back
    }

    /// Gives up the resident image if its step is later than `step` (a
    /// rollback un-commits it).
    pub fn drop_resident_after(&self, step: u64) {
        let dropped = {
            let mut st = self.lock();
            if st.resident.as_ref().is_some_and(|r| r.step > step) {
                st.resident.take()
            } else {
                None
            }
        };
        if let Some(r) = dropped {
            info!(step = r.step, "resident checkpoint dropped: rolled back");
        }
    }

    /// Makes `r` the resident image if it is newer than the one there;
    /// whichever loses is dropped (its lease freed).
    pub fn offer_resident(&self, r: Resident) {
        let loser = {
            let mut st = self.lock();
            if st.resident.as_ref().is_none_or(|old| old.step <= r.step) {
                st.resident.replace(Arc::new(r))
            } else {
                None
            }
        };
        // Dropped outside the lock: freeing a lease takes it.
        drop(loser);
    }

    /// Leases `len_bytes` (rounded up to the block). When it fits the budget
    /// but not the free space, gives up the resident image, then waits for
    /// space; `give_up` is asked every few milliseconds whether to stop
    /// waiting (client gone, daemon aborting). Returns the lease and how
    /// long it waited.
    pub fn acquire(
        self: &Arc<Self>,
        len_bytes: u64,
        what: &str,
        mut give_up: impl FnMut() -> Option<&'static str>,
    ) -> Result<(Lease, Duration), StagingError> {
        let len = config::align_up(len_bytes, STAGING_ALIGN_BYTES);
        if len > self.budget_bytes {
            return Err(StagingError::TooLarge { need_bytes: len, budget_bytes: self.budget_bytes });
        }
        if len == 0 {
            return Ok((Lease { staging: self.clone(), offset_bytes: 0, len_bytes: 0, filler: None }, Duration::ZERO));
        }
        let t0 = Instant::now();
        let mut logged = false;
        let mut st = self.lock();
        loop {
            if let Some(off) = first_fit(&st.free, len) {
                take(&mut st.free, off, len);
                st.used_bytes += len;
                drop(st);
                let waited = t0.elapsed();
                if logged {
                    info!(what, len_bytes = len, waited_s = waited.as_secs_f64(), "staging space found after waiting");
                }
                return Ok((Lease { staging: self.clone(), offset_bytes: off, len_bytes: len, filler: None }, waited));
            }
            if let Some(r) = st.resident.take() {
                info!(step = r.step, "resident checkpoint evicted from staging to make room");
                drop(st);
                drop(r);
                st = self.lock();
                continue;
            }
            // Never wait for the drain: the image it reads from is taken
            // back (it waits for the parts in progress only).
            if let Some(l) = st.lent.take() {
                st.lends_taken_back += 1;
                drop(st);
                info!(
                    step = l.step,
                    "staging: the image lent to the drain taken back to make room (the drain reads the rest from disk)"
                );
                l.take_back();
                st = self.lock();
                continue;
            }
            if !logged {
                warn!(
                    what,
                    len_bytes = len,
                    used_bytes = st.used_bytes,
                    budget_bytes = self.budget_bytes,
                    "staging full: waiting for earlier checkpoints to be written (back-pressure)"
                );
                logged = true;
            }
            if let Some(why) = give_up() {
                return Err(StagingError::GaveUp { why });
            }
            st = self
                .freed
                .wait_timeout(st, Duration::from_millis(config::STAGING_WAIT_POLL_MS))
                .expect("staging lock poisoned")
                .0;
        }
    }

    fn release(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let mut st = self.lock();
        give_back(&mut st.free, offset, len);
        st.used_bytes -= len;
        drop(st);
        self.freed.notify_all();
    }
}

fn first_fit(free: &BTreeMap<u64, u64>, len: u64) -> Option<u64> {
    free.iter().find(|(_, &l)| l >= len).map(|(&o, _)| o)
}

fn take(free: &mut BTreeMap<u64, u64>, off: u64, len: u64) {
    let l = free.remove(&off).expect("extent exists");
    assert!(l >= len);
    if l > len {
        free.insert(off + len, l - len);
    }
}

fn give_back(free: &mut BTreeMap<u64, u64>, off: u64, len: u64) {
    let (mut start, mut end) = (off, off + len);
    if let Some((&po, &pl)) = free.range(..off).next_back() {
        assert!(po + pl <= off, "double free of staging range {off}+{len}");
        if po + pl == off {
            free.remove(&po);
            start = po;
        }
    }
    if let Some((&no, &nl)) = free.range(off..).next() {
        assert!(no >= end, "double free of staging range {off}+{len}");
        if no == end {
            free.remove(&no);
            end = no + nl;
        }
    }
    free.insert(start, end - start);
}

/// An exclusive, block-aligned range of staging memory; freed on drop.
pub struct Lease {
    staging: Arc<Staging>,
    offset_bytes: u64,
    len_bytes: u64,
    /// A copy still filling the range through raw pointers (a save written
    /// while copied): the range is not freed before it ended.
    filler: Option<Arc<Progress>>,
}

impl Lease {
    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// The start of the range. Writes through it are the caller's `unsafe`
    /// to justify: while they may run, no slice of the lease may be taken
    /// (the caller keeps `&mut self` borrowed, or marks the range
    /// [`Lease::filled_by`] the copy).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.staging.buf.as_ptr().wrapping_add(self.offset_bytes as usize)
    }

    /// Panics while a copy still fills the range through raw pointers (a
    /// slice then would alias its writes): a broken invariant.
    fn assert_not_filling(&self) {
        assert!(
            self.filler.as_ref().is_none_or(|p| p.ended()),
            "a slice of a staging lease taken while its copy still fills it"
        );
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.assert_not_filling();
        // SAFETY: offset..offset+len lies inside the live buffer (the
        // allocator hands out only extents of it, and the Arc keeps it
        // mapped); the range is leased to this Lease alone (module
        // invariant); no copy writes it (asserted: a filler's writes end
        // before its outcome is set, progress.rs; a copy without a filler
        // holds `&mut` of this lease throughout, snapshot.rs); the kernel
        // touches it only in a Store call that borrows this lease; and
        // &mut self makes this borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.len_bytes as usize) }
    }

    pub fn as_slice(&self) -> &[u8] {
        self.assert_not_filling();
        let p = self.staging.buf.as_ptr().wrapping_add(self.offset_bytes as usize);
        // SAFETY: as in as_mut_slice; &self means no &mut into this range
        // exists, and the kernel only reads it while this is borrowed
        // (`Store::commit` from `staging_buf`).
        unsafe { std::slice::from_raw_parts(p, self.len_bytes as usize) }
    }

    /// The whole staging buffer, for `Store::commit` with a layout rebased
    /// to this lease's offset: its address and length only (a
    /// [`RawBuf`]); the store never forms a slice of it.
    pub fn staging_buf(&self) -> &RawBuf {
        &self.staging.buf
    }

    /// Marks the range as being filled by whoever drives `progress`: the
    /// holder may then move the lease on (to the committer) while the copy
    /// goes on, and dropping it waits until the copy ended; its slices
    /// refuse until then. Once per lease.
    /// This lease, its earlier filler forgotten (it ended: asserted), to be
    /// filled again: a resident image's lease taken over by a new save.
    pub fn refill(mut self) -> Lease {
        assert!(self.filler.take().is_none_or(|p| p.ended()), "a staging lease refilled while its copy still fills it");
        self
    }

    pub fn filled_by(&mut self, progress: Arc<Progress>) {
        assert!(self.filler.is_none(), "a staging lease filled twice");
        self.filler = Some(progress);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(p) = self.filler.take() {
            // The copy writes into this range until it ends (it always does:
            // a dropped filler fails it).
            let _ = p.outcome();
        }
        self.staging.release(self.offset_bytes, self.len_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_disjoint_coalesce_and_wait() {
        let s = Staging::new(4 << 20).unwrap();
        let (a, _) = s.acquire(1 << 20, "a", || None).unwrap();
        let (b, _) = s.acquire(2 << 20, "b", || None).unwrap();
        assert_eq!(a.offset_bytes(), 0);
        assert_eq!(b.offset_bytes(), 1 << 20);
        assert_eq!(s.used_bytes(), 3 << 20);
        // Does not fit the free 1 MiB: waits until given up.
        let mut n = 0;
        assert!(matches!(
            s.acquire(2 << 20, "c", || {
                n += 1;
                (n > 2).then_some("test")
            }),
            Err(StagingError::GaveUp { .. })
        ));
        assert!(matches!(s.acquire(5 << 20, "d", || None), Err(StagingError::TooLarge { .. })));
        drop(a);
        drop(b);
        assert_eq!(s.used_bytes(), 0);
        // Coalesced back into one extent: the whole budget fits.
        let (c, _) = s.acquire(4 << 20, "e", || None).unwrap();
        assert_eq!(c.len_bytes(), 4 << 20);
    }

    /// A lease handed on while its copy still wrote into it gave
    /// out a slice of those bytes (aliasing the copy's raw writes).
    #[test]
    fn a_lease_gives_no_slice_while_its_copy_fills_it() {
        let s = Staging::new(4 << 20).unwrap();
        let (mut lease, _) = s.acquire(1 << 20, "a", || None).unwrap();
        lease.as_mut_slice()[0] = 7;
        let progress = Arc::new(Progress::new(vec![0], 1 << 20));
        lease.filled_by(progress.clone());
        let refused = |f: &mut dyn FnMut()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
        assert!(
            refused(&mut || {
                let _ = lease.as_slice();
            }),
            "a shared slice while filling"
        );
        assert!(
            refused(&mut || {
                let _ = lease.as_mut_slice();
            }),
            "a mutable slice while filling"
        );
        assert!(refused(&mut || lease.filled_by(progress.clone())), "a second filler");
        progress.finish(vec![]);
        assert_eq!(lease.as_slice()[0], 7);
        lease.as_mut_slice()[1] = 8;
        assert_eq!(lease.as_slice()[..2], [7, 8]);
    }

    #[test]
    fn a_waiting_save_gets_space_when_a_lease_drops_and_evicts_the_resident() {
        let s = Staging::new(4 << 20).unwrap();
        let (a, _) = s.acquire(3 << 20, "a", || None).unwrap();
        let s2 = s.clone();
        // `give_up` is first asked once the acquire is waiting for space.
        let (waiting_tx, waiting_rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            s2.acquire(2 << 20, "b", || {
                let _ = waiting_tx.send(());
                None
            })
            .map(|(l, w)| (l.offset_bytes(), w))
        });
        waiting_rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(120));
        drop(a);
        let (off, waited) = h.join().unwrap().unwrap();
        assert_eq!(off, 0);
        assert!(waited >= Duration::from_millis(100));
        let (r, _) = s.acquire(3 << 20, "r", || None).unwrap();
        let layout = Layout::plan(vec![], Default::default()).unwrap();
        s.offer_resident(Resident {
            step: 1,
            layout,
            crcs: vec![],
            digests: None,
            blobs: vec![],
            lease: r,
            origin: std::sync::Weak::<()>::new(),
        });
        assert_eq!(s.resident_step(), Some(1));
        let (_x, _) = s.acquire(3 << 20, "x", || Some("must not wait")).unwrap();
        assert_eq!(s.resident_step(), None);
    }
    /// A drain part reading `lent`'s image, begun when this returns (the
    /// step it read checked); it ends when the sender is sent to.
    fn part_in_progress(lent: &Arc<Lent>) -> (std::thread::JoinHandle<Option<()>>, std::sync::mpsc::Sender<()>) {
        let (in_part_tx, in_part_rx) = std::sync::mpsc::channel();
        let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
        let l2 = lent.clone();
        let part = std::thread::spawn(move || {
            l2.with(|r| {
                in_part_tx.send(r.step).unwrap();
                finish_rx.recv().unwrap();
            })
        });
        assert_eq!(
            in_part_rx.recv_timeout(Duration::from_secs(60)).unwrap(),
            lent.step(),
            "the part reads the lent step"
        );
        (part, finish_tx)
    }

    fn resident(s: &Arc<Staging>, step: u64, len: u64) -> Resident {
        let (lease, _) = s.acquire(len, "r", || Some("must not wait")).unwrap();
        Resident {
            step,
            layout: Layout::plan(vec![], Default::default()).unwrap(),
            crcs: vec![],
            digests: None,
            blobs: vec![],
            lease,
            origin: std::sync::Weak::<()>::new(),
        }
    }

    /// Draining from staging: a save that needs the space of the
    /// image lent to the drain gets it while the drain's upload is still
    /// going on (its loan not ended): it waits only for the part in
    /// progress, then the drain reads no more from that image.
    #[test]
    fn a_save_takes_back_the_image_lent_to_the_drain_without_waiting_for_its_upload() {
        let s = Staging::new(4 << 20).unwrap();
        s.offer_resident(resident(&s, 1, 3 << 20));
        let lent = s.lend_resident(1).expect("the resident step is lent");
        assert!(s.lend_resident(2).is_none(), "only the resident step is lent");
        // lend_resident(2) ended the first loan: lend again.
        let lent = {
            drop(lent);
            s.lend_resident(1).unwrap()
        };
        // A part in progress: the drain reads the image until told to stop.
        let (part, finish_tx) = part_in_progress(&lent);
        // A save needing 3 MiB of the 4: only the lent image's space fits it.
        let s2 = s.clone();
        let (got_tx, got_rx) = std::sync::mpsc::channel();
        let save = std::thread::spawn(move || {
            let r = s2.acquire(3 << 20, "save", || None).map(|(l, _)| l.len_bytes());
            got_tx.send(()).unwrap();
            r
        });
        // The part in progress ends; the drain has not ended its loan (its
        // upload goes on, from disk), yet the save gets its space.
        finish_tx.send(()).unwrap();
        assert_eq!(part.join().unwrap(), Some(()));
        got_rx.recv_timeout(Duration::from_secs(60)).expect("the save got its space before the drain's upload ended");
        assert_eq!(save.join().unwrap().unwrap(), 3 << 20);
        assert!(lent.with(|_| ()).is_none() && !lent.is_lent(), "the drain reads no more from the image");
        assert_eq!(s.lends_taken_back(), 1);
        s.end_lend(&lent);
    }

    /// A save that adopts the resident image in place takes it back from
    /// the drain first (the drain goes on from disk).
    #[test]
    fn adopting_the_resident_takes_it_back_from_the_drain() {
        let s = Staging::new(4 << 20).unwrap();
        s.offer_resident(resident(&s, 5, 1 << 20));
        let lent = s.lend_resident(5).unwrap();
        let (r, step) = s.take_resident_with(|r| Some(r.step)).expect("adopted although lent");
        assert_eq!((r.step, step), (5, 5));
        assert!(!lent.is_lent());
        assert_eq!(s.lends_taken_back(), 1);
        s.end_lend(&lent);
    }

    /// A save's snapshot never waits for the drain: while a part is being
    /// read from the lent image, adopting it is declined at once (the save
    /// copies) and the loan goes on; once no read is in progress, the save
    /// adopts it.
    #[test]
    fn a_save_does_not_wait_for_a_drain_part_in_progress_to_adopt_the_resident() {
        let s = Staging::new(4 << 20).unwrap();
        s.offer_resident(resident(&s, 7, 1 << 20));
        let lent = s.lend_resident(7).unwrap();
        let (part, finish_tx) = part_in_progress(&lent);
        // The part is still in progress (it waits for finish_tx): a call
        // that waited for it would never answer (the deadline bounds that).
        let (s2, (ans_tx, ans_rx)) = (s.clone(), std::sync::mpsc::channel());
        std::thread::spawn(move || ans_tx.send(s2.take_resident_with(|r| Some(r.step)).map(|(r, _)| r.step)));
        let adopted = ans_rx.recv_timeout(Duration::from_secs(60)).expect("the save did not wait for the drain's part");
        assert_eq!(adopted, None, "nothing adopted while a part is read");
        assert!(lent.is_lent(), "the loan goes on");
        assert_eq!(s.resident_step(), Some(7));
        finish_tx.send(()).unwrap();
        assert_eq!(part.join().unwrap(), Some(()));
        let (r, _) = s.take_resident_with(|r| Some(r.step)).expect("adopted once no part is read");
        assert_eq!(r.step, 7);
        assert!(!lent.is_lent());
        s.end_lend(&lent);
    }
}
