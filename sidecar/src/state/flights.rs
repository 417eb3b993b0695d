//! The in-flight registry: every checkpoint (a step, one rank's part of
//! a step) and SaveFile from the moment it passed its checks until it is
//! durable, failed or aborted, with its phase for `status`; the daemon
//! drains by waiting for it to be empty.
//!
//! Invariants: a key is in the registry at most once; a whole save and a
//! part of the same step are never both in it; ending a key that is not in
//! flight is a broken invariant (assert).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use ckpt_wire::InFlight;

use crate::state::jobs::Flight;
use crate::state::Phase;

struct InFlightEntry {
    phase: Phase,
    bytes: u64,
    file: Option<String>,
}

pub(super) struct Flights {
    in_flight: Mutex<BTreeMap<Flight, InFlightEntry>>,
    next_file_no: AtomicU64,
    in_flight_cv: Condvar,
}

impl Flights {
    pub(super) fn new() -> Flights {
        Flights {
            in_flight: Mutex::new(BTreeMap::new()),
            next_file_no: AtomicU64::new(1),
            in_flight_cv: Condvar::new(),
        }
    }

    /// See [`DaemonState::begin_step`](crate::state::DaemonState::begin_step).
    pub(super) fn begin_step(&self, key: Flight, bytes: u64) -> bool {
        let mut m = self.in_flight.lock().expect("in-flight lock");
        let step = key.step().expect("a step key");
        let clash = m.contains_key(&key)
            || match key {
                Flight::Step(_) => m.range(Flight::Part(step, 0)..=Flight::Part(step, u32::MAX)).next().is_some(),
                _ => m.contains_key(&Flight::Step(step)),
            };
        if clash {
            return false;
        }
        // Counted before it shows in flight: a scrape, which reads the
        // flights and then the counters, never sees more in flight than
        // started (metrics.rs).
        crate::state::metrics::record_started();
        m.insert(key, InFlightEntry { phase: Phase::WaitingForStaging, bytes, file: None });
        true
    }

    pub(super) fn begin_file(&self, path: &str, bytes: u64) -> Flight {
        let key = Flight::File(self.next_file_no.fetch_add(1, Ordering::Relaxed));
        let entry = InFlightEntry { phase: Phase::WaitingForStaging, bytes, file: Some(path.to_string()) };
        // Counted before it shows in flight, as in begin_step.
        crate::state::metrics::record_started();
        self.in_flight.lock().expect("in-flight lock").insert(key, entry);
        key
    }

    pub(super) fn set_phase(&self, key: Flight, phase: Phase) {
        if let Some(e) = self.in_flight.lock().expect("in-flight lock").get_mut(&key) {
            e.phase = phase;
        }
    }

    pub(super) fn end(&self, key: Flight) {
        let removed = self.in_flight.lock().expect("in-flight lock").remove(&key);
        assert!(removed.is_some(), "{key:?} ended but was not in flight");
        self.in_flight_cv.notify_all();
    }

    pub(super) fn len(&self) -> usize {
        self.in_flight.lock().expect("in-flight lock").len()
    }

    pub(super) fn wait_empty(&self, timeout: Duration) -> bool {
        let m = self.in_flight.lock().expect("in-flight lock");
        let (m, _) = self.in_flight_cv.wait_timeout_while(m, timeout, |m| !m.is_empty()).expect("in-flight lock");
        m.is_empty()
    }

    /// The registry as `status` shows it.
    pub(super) fn report(&self) -> Vec<InFlight> {
        self.in_flight
            .lock()
            .expect("in-flight lock")
            .iter()
            .map(|(key, e)| InFlight {
                step: key.step().unwrap_or(0),
                file: e.file.clone(),
                phase: e.phase.as_str().to_string(),
                bytes: e.bytes,
            })
            .collect()
    }
}
