//! Shedding is logged as one WARN line per interval while it lasts, with the count per
//! reason, rather than one line per refused request (which would flood the log, and cost
//! the CPU a refusal must not).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::app::App;

/// How often shedding is summarised.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// Logs the requests and connections shed in each interval until `stop` turns true.
pub async fn summarise(app: Arc<App>, mut stop: watch::Receiver<bool>) {
    let mut last = app.front_stats().shed;
    let mut tick = tokio::time::interval(INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let stats = app.front_stats();
        let now = stats.shed;
        if let Some((total, by_reason)) = summary(&last, &now) {
            // The adaptive limit (rows in flight), 0 under the estimate rule.
            tracing::warn!(
                total,
                by_reason = %by_reason,
                limit = stats.limit.unwrap_or(0),
                interval_s = INTERVAL.as_secs_f64(),
                "requests shed"
            );
        }
        last = now;
    }
}

/// What was shed between two readings of the counters: the total and `reason=count` pairs;
/// `None` when nothing was.
fn summary(before: &[(&str, u64)], now: &[(&str, u64)]) -> Option<(u64, String)> {
    let mut total = 0;
    let mut parts = Vec::new();
    for &(reason, n) in now {
        let was = before.iter().find(|b| b.0 == reason).map_or(0, |b| b.1);
        let shed = n.saturating_sub(was);
        if shed > 0 {
            total += shed;
            parts.push(format!("{reason}={shed}"));
        }
    }
    (total > 0).then(|| (total, parts.join(",")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_reason_since_the_last_reading() {
        let before = [("connections", 1), ("in_flight", 5), ("estimate", 0)];
        assert_eq!(summary(&before, &before), None);
        let now = [("connections", 1), ("in_flight", 9), ("estimate", 2)];
        assert_eq!(
            summary(&before, &now),
            Some((6, "in_flight=4,estimate=2".to_string()))
        );
    }
}
