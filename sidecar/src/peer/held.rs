//! The replicas this sidecar holds for other nodes: the newest `keep`
//! steps of each node, in memory, within a budget of bytes. Room is
//! reserved before a replica's bytes are read (so concurrent offers never
//! overrun the budget together) and a replica is inserted only once every
//! byte of it was checked; then the node's older steps past `keep` go,
//! their memory kept (within the same budget) for the next replica's
//! receive ([`super::pool`]). With a spill folder (`--peer-spill DIR`), a
//! replica that does not fit the budget is received into files there
//! instead of being refused; it counts towards `keep` as one in memory,
//! and goes (its folder removed) as one would.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::pool::{Pool, Pooled};

/// The folder of `--peer-spill DIR` that spilled replicas go into.
pub const SPILL_FOLDER: &str = "ckpt-peer-spill";

/// One node's files of one step, checked against the step's index.
pub struct Replica {
    pub files: HashMap<String, ReplicaFile>,
    pub bytes: u64,
    /// Received into the spill folder: this folder holds its files.
    pub spilled: Option<PathBuf>,
}

/// A held file: in memory, or in the spill folder.
#[derive(Clone)]
pub enum ReplicaFile {
    Mem(Arc<Pooled>),
    Disk { path: PathBuf, len_bytes: u64 },
}

impl ReplicaFile {
    pub fn len_bytes(&self) -> u64 {
        match self {
            ReplicaFile::Mem(b) => b.as_slice().len() as u64,
            ReplicaFile::Disk { len_bytes, .. } => *len_bytes,
        }
    }
}

impl Replica {
    /// Its bytes against the budget: those in memory (a spilled one: none).
    fn in_memory(&self) -> u64 {
        if self.spilled.is_some() {
            0
        } else {
            self.bytes
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(dir) = &self.spilled {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::warn!("peers: a spilled replica's folder {} stays ({e})", dir.display());
            }
        }
    }
}

pub struct Held {
    budget_bytes: u64,
    keep: usize,
    /// `--peer-spill DIR`: where replicas that do not fit the budget go.
    spill: Option<PathBuf>,
    inner: Mutex<Inner>,
    /// The replicas' buffers: an evicted replica's are the next one's.
    pool: Arc<Pool>,
}

#[derive(Default)]
struct Inner {
    by_node: BTreeMap<String, BTreeMap<u64, Arc<Replica>>>,
    bytes: u64,
    reserved: u64,
}

/// Room reserved for a replica being received; released when dropped.
pub struct Reservation<'a> {
    held: &'a Held,
    bytes: u64,
    /// The replica goes into this folder (the spill), not into memory.
    pub spill_to: Option<PathBuf>,
}

impl Drop for Reservation<'_> {
    /// Room given back; a spill folder no replica took (a receive that
    /// failed) removed.
    fn drop(&mut self) {
        self.held.lock().reserved -= self.bytes;
        if let Some(dir) = self.spill_to.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Held {
    /// `spill`: a folder whose [`SPILL_FOLDER`] replicas that do not fit
    /// the budget are received into (emptied here: a replica of an earlier
    /// run is not known to this one; nothing else of `spill` is touched).
    pub fn new(budget_bytes: u64, keep: usize, spill: Option<PathBuf>) -> std::io::Result<Held> {
        let spill = spill.map(|dir| dir.join(SPILL_FOLDER));
        if let Some(dir) = &spill {
            empty_folder(dir)?;
        }
        Ok(Held {
            budget_bytes,
            keep: keep.max(1),
            spill,
            inner: Mutex::new(Inner::default()),
            pool: Pool::new(budget_bytes),
        })
    }

    /// Memory for `len` bytes of a replica being received (room for it
    /// reserved first): pre-faulted, an evicted replica's where one fits.
    pub fn buffer(&self, len: usize) -> std::io::Result<Pooled> {
        self.pool.take(len)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("held replicas lock")
    }

    /// Room for `bytes` of `node`'s step `step`, counting as free the
    /// bytes of the node's older steps its insertion would evict; why not.
    pub fn reserve(&self, node: &str, step: u64, bytes: u64) -> Result<Reservation<'_>, String> {
        let mut g = self.lock();
        let freed: u64 = g.by_node.get(node).map_or(0, |steps| {
            let older: Vec<u64> = steps.keys().copied().filter(|&s| s != step).collect();
            let evicted = older.len().saturating_sub(self.keep - 1);
            older.iter().take(evicted).map(|s| steps[s].in_memory()).sum::<u64>()
                + steps.get(&step).map_or(0, |r| r.in_memory())
        });
        let after = (g.bytes + g.reserved + bytes).saturating_sub(freed);
        if after > self.budget_bytes {
            if let Some(dir) = &self.spill {
                // Each replica in a folder of its own: one of the same
                // node and step being replaced keeps its own until then.
                let folder = dir.join(format!("{node}.{step}.{:016x}", ckpt_store::io::nonce()));
                return Ok(Reservation { held: self, bytes: 0, spill_to: Some(folder) });
            }
            return Err(format!(
                "node {node:?} step {step}: {bytes} bytes do not fit the peer budget ({} of {} bytes held or arriving)",
                g.bytes + g.reserved,
                self.budget_bytes
            ));
        }
        g.reserved += bytes;
        Ok(Reservation { held: self, bytes, spill_to: None })
    }

    /// A checked replica in; the node's steps past the newest `keep` out.
    pub fn insert(&self, mut room: Reservation<'_>, node: &str, step: u64, replica: Replica) {
        // A spilled replica's folder is its own now.
        room.spill_to = None;
        let added = replica.in_memory();
        let mut g = self.lock();
        let steps = g.by_node.entry(node.to_string()).or_default();
        let mut evicted: Vec<Arc<Replica>> = steps.insert(step, Arc::new(replica)).into_iter().collect();
        while steps.len() > self.keep {
            evicted.push(steps.pop_first().expect("more than keep").1);
        }
        let freed: u64 = evicted.iter().map(|r| r.in_memory()).sum();
        g.bytes = g.bytes + added - freed;
        // The evicted replicas' buffers go back to the pool after the lock.
        drop(g);
        drop(evicted);
    }

    /// File `name` of `node`'s replica of `step`, if held.
    pub fn file(&self, node: &str, step: u64, name: &str) -> Option<ReplicaFile> {
        self.lock().by_node.get(node)?.get(&step)?.files.get(name).cloned()
    }

    /// The steps of `node` held.
    pub fn steps(&self, node: &str) -> Vec<u64> {
        self.lock().by_node.get(node).map_or_else(Vec::new, |s| s.keys().copied().collect())
    }

    /// (node, step) of every replica held (spilled ones too), and the
    /// bytes of those in memory.
    pub fn summary(&self) -> (Vec<(String, u64)>, u64) {
        let g = self.lock();
        let list = g.by_node.iter().flat_map(|(n, steps)| steps.keys().map(move |s| (n.clone(), *s))).collect();
        (list, g.bytes)
    }
}

/// Removes what `dir` holds (creating it if missing).
fn empty_folder(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            std::fs::remove_dir_all(&p)?;
        } else {
            std::fs::remove_file(&p)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(bytes: u64) -> Replica {
        Replica { files: HashMap::new(), bytes, spilled: None }
    }

    #[test]
    fn the_newest_keep_steps_of_a_node_are_held_within_the_budget() {
        let h = Held::new(100, 2, None).unwrap();
        for step in 1..=3 {
            let room = h.reserve("a", step, 40).unwrap();
            h.insert(room, "a", step, replica(40));
        }
        assert_eq!(h.summary(), (vec![("a".into(), 2), ("a".into(), 3)], 80));
        // Another node's 40 bytes do not fit beside a's 80, and nothing of a's goes for them.
        let e = h.reserve("b", 1, 40).err().unwrap();
        assert!(e.contains("peer budget"), "{e}");
        // a's next step fits: its oldest is evicted by it.
        let room = h.reserve("a", 4, 40).unwrap();
        // Reserved room counts against the budget until it is used or dropped.
        assert!(h.reserve("b", 1, 20).is_err());
        h.insert(room, "a", 4, replica(40));
        assert_eq!(h.steps("a"), vec![3, 4]);
        assert!(h.reserve("b", 1, 20).is_ok());
    }

    #[test]
    fn an_evicted_replicas_memory_receives_the_next_step() {
        let len = 3 << 20;
        let h = Held::new(64 << 20, 2, None).unwrap();
        let mut addrs = Vec::new();
        for step in 1..=5 {
            let room = h.reserve("a", step, len as u64).unwrap();
            let buf = h.buffer(len).unwrap();
            addrs.push((buf.as_slice().as_ptr() as usize, buf.fresh));
            let files = HashMap::from([("f".to_string(), ReplicaFile::Mem(Arc::new(buf)))]);
            h.insert(room, "a", step, Replica { files, bytes: len as u64, spilled: None });
        }
        // Steps 1..3 find nothing spare (two held, the third arriving);
        // step 4 gets step 1's memory, step 5 step 2's.
        let fresh: Vec<bool> = addrs.iter().map(|a| a.1).collect();
        assert_eq!(fresh, [true, true, true, false, false]);
        assert_eq!(addrs[3].0, addrs[0].0);
        assert_eq!(addrs[4].0, addrs[1].0);
    }

    #[test]
    fn with_a_spill_folder_a_replica_over_the_budget_goes_there_and_its_folder_goes_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let spill = dir.path().join(SPILL_FOLDER);
        std::fs::create_dir_all(spill.join("stale")).unwrap();
        std::fs::write(dir.path().join("other"), b"not ours").unwrap();
        let h = Held::new(100, 2, Some(dir.path().to_path_buf())).unwrap();
        // What an earlier run left is not known here: emptied; the rest of the folder is not ours.
        assert_eq!(std::fs::read_dir(&spill).unwrap().count(), 0);
        assert!(dir.path().join("other").exists());
        let room = h.reserve("a", 1, 80).unwrap();
        assert!(room.spill_to.is_none());
        // A spill reservation whose receive failed leaves no folder.
        let failed = h.reserve("b", 9, 200).unwrap();
        let folder9 = failed.spill_to.clone().expect("spilled");
        std::fs::create_dir_all(&folder9).unwrap();
        std::fs::write(folder9.join("half"), b"x").unwrap();
        drop(failed);
        assert!(!folder9.exists());
        h.insert(room, "a", 1, replica(80));
        // 80 more do not fit the memory budget: a folder in the spill, no room counted.
        let room = h.reserve("b", 1, 80).unwrap();
        let folder = room.spill_to.clone().expect("spilled");
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join("f"), b"x").unwrap();
        let files = HashMap::from([("f".to_string(), ReplicaFile::Disk { path: folder.join("f"), len_bytes: 1 })]);
        h.insert(room, "b", 1, Replica { files, bytes: 80, spilled: Some(folder.clone()) });
        assert_eq!(h.summary(), (vec![("a".into(), 1), ("b".into(), 1)], 80));
        assert!(matches!(h.file("b", 1, "f"), Some(ReplicaFile::Disk { len_bytes: 1, .. })));
        // b's newer steps evict it as any other: its folder goes.
        for step in 2..=3 {
            let room = h.reserve("b", step, 80).unwrap();
            let f = room.spill_to.clone();
            std::fs::create_dir_all(f.as_ref().expect("spilled too")).unwrap();
            h.insert(room, "b", step, Replica { files: HashMap::new(), bytes: 80, spilled: f });
        }
        assert_eq!(h.steps("b"), vec![2, 3]);
        assert!(!folder.exists());
        assert_eq!(std::fs::read_dir(&spill).unwrap().count(), 2);
    }
}
