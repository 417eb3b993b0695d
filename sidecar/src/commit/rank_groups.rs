//! The coordinator: gathers the parts of a checkpoint that several ranks
//! save (SavePart) until every rank's part of a step is here, then hands the
//! whole group to the committer, which commits it as one checkpoint.
//!
//! It lives on the committer thread (no locks). Each part arrives copied
//! into its own staging lease, released, checksummed: from then on no
//! trainer has to be alive for the step to commit.
//!
//! Invariants: a step's group holds at most one part per rank, all of one
//! world size; a group that is not complete `timeout` after its first part
//! arrived is given up (every part answered Failed, every lease freed),
//! so a rank that died before its part was released means the step never
//! commits; a part of another world size than its group's is refused alone.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::state::jobs::Job;

/// What offering a part did.
pub enum Offer {
    /// Waiting for the other ranks.
    Pending,
    /// Every rank's part of the step, by rank.
    Complete(Vec<Job>),
    /// The part does not fit its step's group; it is handed back with why.
    Refused(Box<Job>, String),
}

struct Group {
    world_size: u32,
    parts: BTreeMap<u32, Job>,
    since: Instant,
}

pub struct RankGroups {
    pending: BTreeMap<u64, Group>,
    timeout: Duration,
    /// Steps given up lately: when, and the ranks whose parts had come. A
    /// rank that resumes after the timeout starts the step anew alone; when
    /// that attempt is given up too, its reason says which missing ranks
    /// did send, to the earlier attempt. Kept for twice the timeout.
    given_up: BTreeMap<u64, (Instant, Vec<u32>)>,
}

/// A group given up at its timeout.
pub struct Expired {
    pub step: u64,
    pub world_size: u32,
    /// The ranks whose parts did not come to this attempt.
    pub missing: Vec<u32>,
    /// Those of `missing` whose parts came to an earlier attempt of the
    /// step, itself given up (they must save the step again).
    pub sent_earlier: Vec<u32>,
    /// The parts that came.
    pub parts: Vec<Job>,
}

impl RankGroups {
    pub fn new(timeout: Duration) -> RankGroups {
        RankGroups { pending: BTreeMap::new(), timeout, given_up: BTreeMap::new() }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Adds one rank's part (a Job whose `part` is Some).
    pub fn offer(&mut self, job: Job) -> Offer {
        let part = job.part.expect("only parts are gathered");
        let step = job.step;
        let g = self.pending.entry(step).or_insert_with(|| Group {
            world_size: part.world_size,
            parts: BTreeMap::new(),
            since: Instant::now(),
        });
        if g.world_size != part.world_size {
            let why = format!(
                "step {step}: rank {} says world size {}, but earlier ranks said {}",
                part.rank, part.world_size, g.world_size
            );
            return Offer::Refused(Box::new(job), why);
        }
        if g.parts.contains_key(&part.rank) {
            let why = format!("step {step}: rank {} sent its part twice", part.rank);
            return Offer::Refused(Box::new(job), why);
        }
        g.parts.insert(part.rank, job);
        if g.parts.len() as u32 == g.world_size {
            let g = self.pending.remove(&step).expect("the group just filled");
            return Offer::Complete(g.parts.into_values().collect());
        }
        Offer::Pending
    }

    /// When the oldest incomplete group times out, if any.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.values().map(|g| g.since + self.timeout).min()
    }

    /// Removes the groups whose time is up at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Expired> {
        let keep = self.timeout * 2;
        self.given_up.retain(|_, (when, _)| now.duration_since(*when) < keep);
        let late: Vec<u64> =
            self.pending.iter().filter(|(_, g)| now >= g.since + self.timeout).map(|(&s, _)| s).collect();
        late.into_iter()
            .map(|step| {
                let g = self.pending.remove(&step).expect("listed above");
                let missing: Vec<u32> = (0..g.world_size).filter(|r| !g.parts.contains_key(r)).collect();
                let sent_earlier = match self.given_up.get(&step) {
                    Some((when, sent)) if *when <= g.since => {
                        missing.iter().copied().filter(|r| sent.contains(r)).collect()
                    }
                    _ => Vec::new(),
                };
                self.given_up.insert(step, (now, g.parts.keys().copied().collect()));
                Expired {
                    step,
                    world_size: g.world_size,
                    missing,
                    sent_earlier,
                    parts: g.parts.into_values().collect(),
                }
            })
            .collect()
    }

    /// Every part still waiting (to fail them when the sidecar aborts).
    pub fn take_all(&mut self) -> Vec<Job> {
        std::mem::take(&mut self.pending).into_values().flat_map(|g| g.parts.into_values()).collect()
    }
}
