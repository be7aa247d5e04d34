//! The one wall-clock helper: time since the Unix epoch, saturating (a clock before 1970 reads 0).

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Seconds since the epoch.
pub fn now_s() -> u64 {
    now_ms() / 1000
}

#[cfg(test)]
mod tests {
    #[test]
    fn after_2020() {
        assert!(super::now_ms() > 1_577_836_800_000);
        assert_eq!(super::now_s(), super::now_ms() / 1000);
    }
}
