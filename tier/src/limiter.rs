//! A token bucket shared by every part of every upload of one target, so
//! that `bandwidth_bytes_per_s` bounds the whole drain, however many parts
//! are in flight; the sidecar's replication to its peers is paced by one
//! too (`--peer-bandwidth`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many seconds of traffic the bucket may hold when idle: a short burst
/// after a pause, never a second's worth of catch-up.
const BURST_SECONDS: f64 = 0.25;

#[derive(Debug)]
pub struct TokenBucket {
    rate_bytes_per_s: f64,
    burst_bytes: f64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Negative while in debt: a part larger than the burst is let through
    /// at once and the parts after it wait the debt off.
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    pub fn new(rate_bytes_per_s: u64) -> TokenBucket {
        let rate = rate_bytes_per_s.max(1) as f64;
        TokenBucket {
            rate_bytes_per_s: rate,
            burst_bytes: rate * BURST_SECONDS,
            state: Mutex::new(State { tokens: 0.0, at: Instant::now() }),
        }
    }

    /// Takes `bytes` tokens; returns how long the caller must wait before
    /// sending them (zero when the bucket had them).
    pub fn take(&self, bytes: u64) -> Duration {
        let mut s = self.state.lock().expect("token bucket lock");
        let now = Instant::now();
        let refill = now.duration_since(s.at).as_secs_f64() * self.rate_bytes_per_s;
        s.tokens = (s.tokens + refill).min(self.burst_bytes);
        s.at = now;
        s.tokens -= bytes as f64;
        if s.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-s.tokens / self.rate_bytes_per_s)
        }
    }

    pub(crate) async fn acquire(&self, bytes: u64) {
        let wait = self.take(bytes);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }

    /// [`TokenBucket::acquire`] for a thread that may block: sleeps off
    /// what `bytes` cost.
    pub fn acquire_blocking(&self, bytes: u64) {
        let wait = self.take(bytes);
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }

    /// The rate, in bytes per second.
    pub fn rate_bytes_per_s(&self) -> u64 {
        self.rate_bytes_per_s as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debt_is_waited_off_at_the_rate() {
        // 1 byte/s, so that the microseconds between the calls do not count.
        let b = TokenBucket::new(1);
        let w = b.take(500);
        assert!(w <= Duration::from_secs(500) && w > Duration::from_secs(490), "{w:?}");
        // The next 1000 bytes queue behind that debt.
        let w2 = b.take(1000);
        assert!(w2 <= Duration::from_secs(1500) && w2 > Duration::from_secs(1490), "{w2:?}");
    }
}
