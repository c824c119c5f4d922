//! Percentiles of one round, and the median with min-max over rounds: the
//! two levels every number in the report has.

use serde::{Deserialize, Serialize};

/// The `p`-th percentile (0..=100) of `samples` by the nearest-rank method:
/// the smallest sample with at least p% of the samples at or below it.
/// `None` for no samples.
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some(percentile_of_sorted(&sorted, p))
}

/// [`percentile`] of samples already sorted ascending (not empty).
pub fn percentile_of_sorted(sorted: &[f64], p: f64) -> f64 {
    let rank = (p.clamp(0.0, 100.0) / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median of `values` (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    })
}

/// One statistic over several rounds: its median, and its min and max, so
/// the noise is shown next to the value.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub rounds: usize,
}

impl Summary {
    /// `None` for no rounds.
    pub fn of(rounds: &[f64]) -> Option<Self> {
        Some(Self {
            median: median(rounds)?,
            min: rounds.iter().copied().fold(f64::INFINITY, f64::min),
            max: rounds.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            rounds: rounds.len(),
        })
    }

    /// A single measurement.
    pub fn one(value: f64) -> Self {
        Self {
            median: value,
            min: value,
            max: value,
            rounds: 1,
        }
    }

    /// The spread (max - min) relative to the median, e.g. 0.05 for ±2.5%.
    pub fn spread(&self) -> f64 {
        if self.median == 0.0 {
            0.0
        } else {
            (self.max - self.min) / self.median
        }
    }
}

/// `a / b`, or `None` when `b` is zero or either is not finite.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    let r = a / b;
    (b != 0.0 && r.is_finite()).then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&samples, 50.0), Some(50.0));
        assert_eq!(percentile(&samples, 99.0), Some(99.0));
        assert_eq!(percentile(&samples, 100.0), Some(100.0));
        assert_eq!(percentile(&samples, 0.0), Some(1.0));
        // Order does not matter.
        let reversed: Vec<f64> = samples.iter().rev().copied().collect();
        assert_eq!(percentile(&reversed, 99.0), Some(99.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        // p99 of 10 samples is the largest: ceil(9.9) = 10th.
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 99.0), Some(10.0));
        assert_eq!(percentile(&ten, 50.0), Some(5.0));
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn summaries_keep_the_spread() {
        let s = Summary::of(&[10.0, 12.0, 11.0, 30.0, 9.0]).expect("rounds");
        assert_eq!(s.median, 11.0);
        assert_eq!(s.min, 9.0);
        assert_eq!(s.max, 30.0);
        assert_eq!(s.rounds, 5);
        assert!((s.spread() - 21.0 / 11.0).abs() < 1e-12);
        assert_eq!(Summary::of(&[]), None);
        assert_eq!(Summary::one(4.0).spread(), 0.0);
    }

    #[test]
    fn ratios_refuse_zero_denominators() {
        assert_eq!(ratio(3.0, 2.0), Some(1.5));
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(ratio(f64::NAN, 1.0), None);
    }
}
