//! How long to wait before replaying a turn that lost a conflict.
//!
//! Exponential backoff with full jitter: after the n-th lost attempt, a delay drawn uniformly
//! from zero to `base × 2ⁿ⁻¹`, capped. Contenders that collided spread out instead of colliding
//! again in lockstep, and the expected wait stays short while contention is light.

use std::time::Duration;

use rand::Rng;

/// The bound on attempts and the shape of the waits between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// How many times the bot may run for one turn, at least 1.
    pub max_attempts: u32,
    /// The cap of the first wait.
    pub base_delay: Duration,
    /// The cap of any wait.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 10,
            base_delay: Duration::from_millis(2),
            max_delay: Duration::from_millis(200),
        }
    }
}

impl RetryPolicy {
    /// The longest wait after `lost` lost attempts (from 1).
    pub fn ceiling(&self, lost: u32) -> Duration {
        let factor = 1u32.checked_shl(lost.saturating_sub(1)).unwrap_or(u32::MAX);
        self.base_delay.saturating_mul(factor).min(self.max_delay)
    }

    /// A wait after `lost` lost attempts: uniform in `[0, ceiling(lost)]`.
    pub fn delay(&self, lost: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(lost);
        if ceiling.is_zero() {
            return ceiling;
        }
        Duration::from_nanos(
            rng.random_range(0..=u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceilings_double_up_to_the_cap() {
        let policy = RetryPolicy {
            max_attempts: 10,
            base_delay: Duration::from_millis(5),
            max_delay: Duration::from_millis(100),
        };
        let ceilings: Vec<u128> = (1..=7).map(|n| policy.ceiling(n).as_millis()).collect();
        assert_eq!(ceilings, [5, 10, 20, 40, 80, 100, 100]);
        assert_eq!(
            policy.ceiling(200),
            Duration::from_millis(100),
            "no overflow"
        );
    }

    #[test]
    fn delays_are_jittered_within_the_ceiling() {
        let policy = RetryPolicy::default();
        let mut rng = rand::rng();
        let delays: Vec<Duration> = (0..200).map(|_| policy.delay(4, &mut rng)).collect();
        assert!(delays.iter().all(|d| *d <= policy.ceiling(4)));
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 100, "full jitter spreads the waits");
    }
}
