//! Damage the sidecar found in committed steps: a load that fell back past
//! a step or failed on one, the drain's read-back of a local file whose
//! checksum does not match its index, the background scrub (of the local
//! steps, and of the drain target's copies: `scrub_drain`). Kept for
//! `status` (the newest [`config::DAMAGE_RECORDS_MAX`]) and counted for the
//! metrics ([`crate::state::metrics`]).
//!
//! Invariant: one record per (step, file, finder): finding the same damage
//! again (every load of `latest` falls back past the same step) refreshes
//! its time and reason and counts once more in `found_total`, but never
//! pushes other records out.

use std::collections::VecDeque;
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use ckpt_wire::DamageReport;

use crate::config;

/// What found the damage: the label of the metrics series and `status`'s `found_by`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finder {
    Load,
    Drain,
    Scrub,
    /// The scrub, verifying the drain target's copy of a step.
    ScrubDrain,
}

impl Finder {
    pub const ALL: [Finder; 4] = [Finder::Load, Finder::Drain, Finder::Scrub, Finder::ScrubDrain];

    pub fn as_str(self) -> &'static str {
        match self {
            Finder::Load => "load",
            Finder::Drain => "drain",
            Finder::Scrub => "scrub",
            Finder::ScrubDrain => "scrub_drain",
        }
    }
}

#[derive(Default)]
struct Records {
    newest: VecDeque<DamageReport>,
    /// Times damage was found, by finder (the same damage found again counts again).
    found: [u64; Finder::ALL.len()],
    /// Distinct (step, file, finder) records made.
    records_total: u64,
}

fn records() -> &'static Mutex<Records> {
    static R: OnceLock<Mutex<Records>> = OnceLock::new();
    R.get_or_init(Mutex::default)
}

/// `step`'s `file` (empty: the step as a whole) found damaged by `by`, for `reason`.
pub fn record(step: u64, file: &str, reason: &str, by: Finder) {
    let found_unix_s = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut r = records().lock().unwrap_or_else(|e| e.into_inner());
    r.found[by as usize] += 1;
    let same = |d: &DamageReport| d.step == step && d.file == file && d.found_by == by.as_str();
    if let Some(i) = r.newest.iter().position(same) {
        let mut d = r.newest.remove(i).expect("position found");
        d.reason = reason.to_string();
        d.found_unix_s = found_unix_s;
        r.newest.push_back(d);
        return;
    }
    r.records_total += 1;
    if r.newest.len() == config::DAMAGE_RECORDS_MAX {
        r.newest.pop_front();
    }
    r.newest.push_back(DamageReport {
        step,
        file: file.to_string(),
        reason: reason.to_string(),
        found_unix_s,
        found_by: by.as_str().to_string(),
    });
}

/// Records every problem of a load error that says a step is damaged
/// (found by `by`); other errors (not found, I/O, the client's memory) are
/// no damage of a checkpoint.
pub fn record_load_error(e: &ckpt_store::restore::LoadError, by: Finder) {
    use ckpt_store::restore::LoadError;
    match e {
        LoadError::Damaged { step, problems, .. } => record_problems(*step, problems, by),
        LoadError::NoneLoads { tried, shared, .. } => {
            for (step, why) in tried {
                record(*step, shared.as_deref().unwrap_or(""), why, by);
            }
        }
        _ => {}
    }
}

/// Records `step`'s problems, one record per damaged file.
pub fn record_problems(step: u64, problems: &[ckpt_store::restore::Problem], by: Finder) {
    let mut files: Vec<(&str, Vec<String>)> = Vec::new();
    for p in problems {
        let f = p.file.as_deref().unwrap_or("");
        // The file is the record's own field: the reason says the rest.
        let why = match &p.tensor {
            Some(t) => format!("tensor {t:?}: {}", p.what),
            None => p.what.clone(),
        };
        match files.iter_mut().find(|(n, _)| *n == f) {
            Some((_, whys)) => whys.push(why),
            None => files.push((f, vec![why])),
        }
    }
    for (f, whys) in files {
        record(step, f, &whys.join("; "), by);
    }
}

/// The newest records (oldest first) and how many were made since the start.
pub fn report() -> (Vec<DamageReport>, u64) {
    let r = records().lock().unwrap_or_else(|e| e.into_inner());
    (r.newest.iter().cloned().collect(), r.records_total)
}

/// Times damage was found since the start, by finder.
pub fn found_by() -> [(Finder, u64); Finder::ALL.len()] {
    let r = records().lock().unwrap_or_else(|e| e.into_inner());
    Finder::ALL.map(|f| (f, r.found[f as usize]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_damage_found_again_refreshes_its_record_and_the_list_stays_bounded() {
        record(1_000_001, "a", "first", Finder::Scrub);
        record(1_000_001, "a", "again", Finder::Scrub);
        let (list, _) = report();
        let mine: Vec<_> = list.iter().filter(|d| d.step == 1_000_001).collect();
        assert_eq!(mine.len(), 1);
        assert_eq!(mine[0].reason, "again");
        for s in 0..(config::DAMAGE_RECORDS_MAX as u64 + 5) {
            record(2_000_000 + s, "b", "x", Finder::Load);
        }
        let (list, total) = report();
        assert_eq!(list.len(), config::DAMAGE_RECORDS_MAX);
        assert!(total >= config::DAMAGE_RECORDS_MAX as u64 + 6);
        assert_eq!(list.last().unwrap().step, 2_000_000 + config::DAMAGE_RECORDS_MAX as u64 + 4);
    }
}
