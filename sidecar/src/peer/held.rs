//! The replicas this sidecar holds for other nodes: the newest `keep`
//! steps of each node, in memory, within a budget of bytes. Room is
//! reserved before a replica's bytes are read (so concurrent offers never
//! overrun the budget together) and a replica is inserted only once every
//! byte of it was checked; then the node's older steps past `keep` go,
//! their memory kept (within the same budget) for the next replica's
//! receive ([`super::pool`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use super::pool::{Pool, Pooled};

/// One node's files of one step, checked against the step's index.
pub struct Replica {
    pub files: HashMap<String, Arc<Pooled>>,
    pub bytes: u64,
}

pub struct Held {
    budget_bytes: u64,
    keep: usize,
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
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.held.lock().reserved -= self.bytes;
    }
}

impl Held {
    pub fn new(budget_bytes: u64, keep: usize) -> Held {
        Held { budget_bytes, keep: keep.max(1), inner: Mutex::new(Inner::default()), pool: Pool::new(budget_bytes) }
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
            older.iter().take(evicted).map(|s| steps[s].bytes).sum::<u64>() + steps.get(&step).map_or(0, |r| r.bytes)
        });
        let after = (g.bytes + g.reserved + bytes).saturating_sub(freed);
        if after > self.budget_bytes {
            return Err(format!(
                "node {node:?} step {step}: {bytes} bytes do not fit the peer budget ({} of {} bytes held or arriving)",
                g.bytes + g.reserved,
                self.budget_bytes
            ));
        }
        g.reserved += bytes;
        Ok(Reservation { held: self, bytes })
    }

    /// A checked replica in; the node's steps past the newest `keep` out.
    pub fn insert(&self, _room: Reservation<'_>, node: &str, step: u64, replica: Replica) {
        let mut g = self.lock();
        let added = replica.bytes;
        let steps = g.by_node.entry(node.to_string()).or_default();
        let mut evicted: Vec<Arc<Replica>> = steps.insert(step, Arc::new(replica)).into_iter().collect();
        while steps.len() > self.keep {
            evicted.push(steps.pop_first().expect("more than keep").1);
        }
        let freed: u64 = evicted.iter().map(|r| r.bytes).sum();
        g.bytes = g.bytes + added - freed;
        // The evicted replicas' buffers go back to the pool after the lock.
        drop(g);
        drop(evicted);
    }

    /// File `name` of `node`'s replica of `step`, if held.
    pub fn file(&self, node: &str, step: u64, name: &str) -> Option<Arc<Pooled>> {
        self.lock().by_node.get(node)?.get(&step)?.files.get(name).cloned()
    }

    /// The steps of `node` held.
    pub fn steps(&self, node: &str) -> Vec<u64> {
        self.lock().by_node.get(node).map_or_else(Vec::new, |s| s.keys().copied().collect())
    }

    /// (node, step) of every replica held, and their bytes.
    pub fn summary(&self) -> (Vec<(String, u64)>, u64) {
        let g = self.lock();
        let list = g.by_node.iter().flat_map(|(n, steps)| steps.keys().map(move |s| (n.clone(), *s))).collect();
        (list, g.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(bytes: u64) -> Replica {
        Replica { files: HashMap::new(), bytes }
    }

    #[test]
    fn the_newest_keep_steps_of_a_node_are_held_within_the_budget() {
        let h = Held::new(100, 2);
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
        let h = Held::new(64 << 20, 2);
        let mut addrs = Vec::new();
        for step in 1..=5 {
            let room = h.reserve("a", step, len as u64).unwrap();
            let buf = h.buffer(len).unwrap();
            addrs.push((buf.as_slice().as_ptr() as usize, buf.fresh));
            let files = HashMap::from([("f".to_string(), Arc::new(buf))]);
            h.insert(room, "a", step, Replica { files, bytes: len as u64 });
        }
        // Steps 1..3 find nothing spare (two held, the third arriving);
        // step 4 gets step 1's memory, step 5 step 2's.
        let fresh: Vec<bool> = addrs.iter().map(|a| a.1).collect();
        assert_eq!(fresh, [true, true, true, false, false]);
        assert_eq!(addrs[3].0, addrs[0].0);
        assert_eq!(addrs[4].0, addrs[1].0);
    }
}
