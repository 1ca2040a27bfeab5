//! Measurements in one place: latency histograms and process memory.

use hdrhistogram::Histogram;

/// Latency histogram in microseconds, 1 µs to 1 h, 3 significant digits.
pub struct Latency(Histogram<u64>);

impl Default for Latency {
    fn default() -> Self {
        Latency(
            Histogram::new_with_bounds(1, 3_600_000_000, 3).unwrap_or_else(|_| {
                Histogram::new(3).unwrap_or_else(|_| unreachable!("3 significant digits is valid"))
            }),
        )
    }
}

impl Latency {
    pub fn record_us(&mut self, us: u64) {
        self.0.saturating_record(us.max(1));
    }

    /// Quantile in milliseconds.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        self.0.value_at_quantile(q) as f64 / 1000.0
    }

    pub fn max_ms(&self) -> f64 {
        self.0.max() as f64 / 1000.0
    }

    pub fn count(&self) -> u64 {
        self.0.len()
    }
}

/// Resident set size of this process in bytes (Linux `/proc/self/statm`; 0 elsewhere).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|pages| pages * 4096)
        .unwrap_or(0)
}
