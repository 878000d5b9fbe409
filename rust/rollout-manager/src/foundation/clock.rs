//! Wall-clock timestamps for records shown to people (`created_at`, `started_at`). Control
//! logic never uses these: deadlines and intervals come from `tokio::time`.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch, as the seed API reports them.
pub fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
