//! The RL pipeline signal.
//!
//! In fully-async RL the rollout engines are always busy (rollout generates until its
//! staleness limit stops it), so serving metrics say little about whether the fleet has the
//! right size. What matters is the balance between rollout and training, which the trainer
//! sees at every step: how long it waited for rollout data (rollout too slow: add engines) and
//! how long rollout was held back by the staleness limit (rollout too fast: remove engines).
//!
//! Those two look back: a wait is known only once it happened. A report may also carry the
//! rates, which look ahead: how many samples rollout produced in the step (its rate while it
//! was not held back is what the fleet can supply) and how many the next step will take (over
//! the step's training time, the rate the trainer will demand). A jump in demand, or rollout
//! slowing down as responses grow longer, is then seen before the trainer starves on it.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Body of `POST /rollout/pipeline`: one trainer step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PipelineReport {
    /// The trainer's step number (a lower number than the last one starts a new run).
    #[schema(minimum = 0)]
    pub step: u64,
    /// Seconds of this step the trainer spent waiting for rollout data.
    #[schema(minimum = 0)]
    pub trainer_wait_secs: f64,
    /// Seconds of this step rollout was paused by its staleness limit.
    #[schema(minimum = 0)]
    pub rollout_throttled_secs: f64,
    /// Wall-clock length of the step (training plus waiting).
    #[schema(exclusive_minimum = 0)]
    pub step_secs: f64,
    /// Optional, with `next_step_samples`: samples rollout completed during this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_samples: Option<u64>,
    /// Optional, with `rollout_samples`: samples the trainer will consume at its next step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_step_samples: Option<u64>,
}

impl PipelineReport {
    /// Checks the numbers; the error names the field.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.step_secs.is_finite() && self.step_secs > 0.0) {
            return Err(("step_secs", format!("{} must be a positive number of seconds", self.step_secs)));
        }
        for (field, v) in
            [("trainer_wait_secs", self.trainer_wait_secs), ("rollout_throttled_secs", self.rollout_throttled_secs)]
        {
            if !(v.is_finite() && v >= 0.0) {
                return Err((field, format!("{v} must be a number of seconds >= 0")));
            }
            if v > self.step_secs * (1.0 + 1e-9) {
                return Err((field, format!("{v} is longer than the step itself (step_secs {})", self.step_secs)));
            }
        }
        match (self.rollout_samples, self.next_step_samples) {
            (Some(_), None) => {
                return Err(("next_step_samples", "is required with rollout_samples (the rates need both)".into()))
            }
            (None, Some(_)) => {
                return Err(("rollout_samples", "is required with next_step_samples (the rates need both)".into()))
            }
            _ => {}
        }
        Ok(())
    }

    /// Samples per second the trainer will take: the next step's samples over this step's
    /// training time (its length without the wait). None without the field, or when the step
    /// was all waiting.
    pub fn demand_rate(&self) -> Option<f64> {
        let train = self.step_secs - self.trainer_wait_secs;
        let next = self.next_step_samples?;
        (train > 1e-3).then(|| next as f64 / train)
    }

    /// Samples per second rollout produced while it was not held back: what the fleet supplies.
    /// None without the field, or when rollout was held back for more than 90% of the step (a
    /// rate over the rest says nothing: rollout was ahead, e.g. draining a full buffer).
    pub fn supply_rate(&self) -> Option<f64> {
        let running = self.step_secs - self.rollout_throttled_secs;
        let samples = self.rollout_samples?;
        (running >= 0.1 * self.step_secs && running > 1e-3).then(|| samples as f64 / running)
    }

    pub fn wait_fraction(&self) -> f64 {
        (self.trainer_wait_secs / self.step_secs).clamp(0.0, 1.0)
    }

    pub fn throttled_fraction(&self) -> f64 {
        (self.rollout_throttled_secs / self.step_secs).clamp(0.0, 1.0)
    }
}

/// A report with the time it arrived (on the autoscaler's clock).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReceivedReport {
    pub at: f64,
    #[serde(flatten)]
    pub report: PipelineReport,
}

/// The latest reports, newest last, one per step.
#[derive(Debug, Clone, Default)]
pub struct PipelineWindow {
    reports: VecDeque<ReceivedReport>,
}

/// How many reports are kept.
const KEEP: usize = 64;

impl PipelineWindow {
    /// Adds a report: the same step again replaces it; an older step starts a new run.
    pub fn push(&mut self, at: f64, report: PipelineReport) {
        match self.reports.back() {
            Some(last) if report.step == last.report.step => {
                self.reports.pop_back();
            }
            Some(last) if report.step < last.report.step => self.reports.clear(),
            _ => {}
        }
        self.reports.push_back(ReceivedReport { at, report });
        while self.reports.len() > KEEP {
            self.reports.pop_front();
        }
    }

    /// Newest first.
    pub fn recent(&self) -> impl Iterator<Item = &ReceivedReport> {
        self.reports.iter().rev()
    }

    pub fn latest(&self) -> Option<&ReceivedReport> {
        self.reports.back()
    }

    pub fn len(&self) -> usize {
        self.reports.len()
    }

    pub fn is_empty(&self) -> bool {
        self.reports.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64, wait: f64) -> PipelineReport {
        PipelineReport {
            step,
            trainer_wait_secs: wait,
            rollout_throttled_secs: 0.0,
            step_secs: 10.0,
            rollout_samples: None,
            next_step_samples: None,
        }
    }

    #[test]
    fn rates_need_both_fields_and_come_from_the_unblocked_time() {
        let with = |r: Option<u64>, n: Option<u64>| PipelineReport {
            rollout_samples: r,
            next_step_samples: n,
            ..report(1, 4.0)
        };
        assert_eq!(with(Some(10), None).validate().unwrap_err().0, "next_step_samples");
        assert_eq!(with(None, Some(10)).validate().unwrap_err().0, "rollout_samples");
        let r = PipelineReport { rollout_throttled_secs: 2.0, ..with(Some(40), Some(60)) };
        r.validate().unwrap();
        assert_eq!(r.demand_rate(), Some(10.0)); // 60 samples over 10 - 4 s of training
        assert_eq!(r.supply_rate(), Some(5.0)); // 40 samples over 10 - 2 s not held back
        assert_eq!(report(1, 4.0).demand_rate(), None);
        assert_eq!(PipelineReport { trainer_wait_secs: 10.0, ..with(Some(1), Some(1)) }.demand_rate(), None);
        // Held back 95% of the step: no supply figure (not a rate of 0).
        assert_eq!(PipelineReport { rollout_throttled_secs: 9.5, ..with(Some(0), Some(1)) }.supply_rate(), None);
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(report(1, 11.0).validate().unwrap_err().0, "trainer_wait_secs");
        assert_eq!(PipelineReport { step_secs: 0.0, ..report(1, 0.0) }.validate().unwrap_err().0, "step_secs");
        assert_eq!(
            PipelineReport { rollout_throttled_secs: f64::NAN, ..report(1, 0.0) }.validate().unwrap_err().0,
            "rollout_throttled_secs"
        );
        report(1, 10.0).validate().unwrap();
    }

    #[test]
    fn same_step_replaces_and_older_step_restarts() {
        let mut w = PipelineWindow::default();
        w.push(0.0, report(1, 1.0));
        w.push(1.0, report(2, 1.0));
        w.push(2.0, report(2, 5.0));
        assert_eq!(w.len(), 2);
        assert_eq!(w.latest().unwrap().report.trainer_wait_secs, 5.0);
        w.push(3.0, report(0, 0.0));
        assert_eq!(w.len(), 1);
        for step in 1..200 {
            w.push(f64::from(step as u32), report(step, 0.0));
        }
        assert_eq!(w.len(), KEEP);
    }
}
