//! The operations part of the registry: the scale-out and scale-in records, the
//! one-operation lock and the running operation's cancellation token. An operation that runs
//! enters with its lock and its token made in the same step ([`Operations::start_scale_out`],
//! [`Operations::start_scale_in`]), so there is never a running record without the lock or a
//! lock without its record; [`Operations::end`] frees both, and only under the id that holds
//! them.

mod records;
pub use records::{ScaleInRecord, ScaleOutRecord};

use crate::foundation::records::{checked, FailedEngine, RunningOp};
use rollout_core::ids::{EngineId, OpId};
use rollout_core::{Phase, ScaleInEvent, ScaleOutEvent, ScaleOutStatus};
use std::collections::BTreeMap;
use tokio_util::sync::CancellationToken;

/// Finished operations of each kind kept in memory and in the store.
pub const KEEP_OPERATIONS: usize = 1000;

/// The registry's scale operations.
#[derive(Debug, Default)]
pub struct Operations {
    scale_outs: BTreeMap<OpId, ScaleOutRecord>,
    scale_ins: BTreeMap<OpId, ScaleInRecord>,
    /// Mutual exclusion: at most one scale operation runs, with the token that cancels it.
    running: Option<(RunningOp, CancellationToken)>,
}

impl Operations {
    /// The scale operation in progress, if any.
    pub fn running(&self) -> Option<&RunningOp> {
        self.running.as_ref().map(|(op, _)| op)
    }

    /// The token that cancels the running operation `request_id` (None once it ended).
    pub fn cancel_token(&self, request_id: &str) -> Option<CancellationToken> {
        self.running.as_ref().filter(|(op, _)| op.request_id == request_id).map(|(_, token)| token.clone())
    }

    /// Asks the running operation `request_id` to stop (its task rolls back what it did);
    /// false when it is not the one running.
    pub fn cancel(&self, request_id: &str) -> bool {
        let token = self.cancel_token(request_id);
        token.inspect(CancellationToken::cancel).is_some()
    }

    /// Records a scale-out. One that has finished already (a NOOP) is only recorded; one that
    /// runs takes the one-operation lock, and is refused (nothing recorded, the holder named)
    /// while another operation holds it.
    pub fn start_scale_out(&mut self, record: ScaleOutRecord) -> Result<(), RunningOp> {
        let runs = !record.status.is_terminal();
        self.take_lock_if(runs, "scale_out", &record.request_id)?;
        self.scale_outs.insert(record.request_id.clone(), record);
        Ok(())
    }

    /// Like [`Operations::start_scale_out`], for a scale-in.
    pub fn start_scale_in(&mut self, record: ScaleInRecord) -> Result<(), RunningOp> {
        let runs = !record.status.is_terminal();
        self.take_lock_if(runs, "scale_in", &record.request_id)?;
        self.scale_ins.insert(record.request_id.clone(), record);
        Ok(())
    }

    /// While an operation holds the lock every new record is refused, a NOOP too (callers check
    /// [`Operations::running`] first, so a refused NOOP is a bug they log).
    fn take_lock_if(&mut self, runs: bool, kind: &'static str, request_id: &OpId) -> Result<(), RunningOp> {
        if let Some((held, _)) = &self.running {
            return Err(held.clone());
        }
        if runs {
            self.running = Some((RunningOp { kind, request_id: request_id.clone() }, CancellationToken::new()));
        }
        Ok(())
    }

    /// Puts back a scale-out read from the store after a restart (the lock is not taken: the
    /// task that ran it is gone).
    pub fn restore_scale_out(&mut self, record: ScaleOutRecord) {
        self.scale_outs.insert(record.request_id.clone(), record);
    }

    /// A scale-out the manager's restart interrupted, whose engines are all ACTIVE: it ends
    /// ACTIVE (one still PENDING, waiting for its placements, cannot, and ends FAILED).
    pub fn complete_scale_out_after_restart(&mut self, request_id: &str) {
        let Some(op) = self.scale_outs.get_mut(request_id).filter(|op| !op.status.is_terminal()) else { return };
        op.advance_to(Phase::Ready);
        op.message = format!("{} (completed after a manager restart)", op.message);
        if let Err(e) = op.apply(ScaleOutEvent::Activated) {
            tracing::warn!(request_id = %request_id, error = %e, "interrupted scale-out could not complete");
            checked(op.apply(ScaleOutEvent::Fail));
        }
    }

    /// A scale-out the manager's restart interrupted that cannot complete: FAILED with `why`.
    pub fn fail_scale_out_after_restart(&mut self, request_id: &str, why: String) {
        let Some(op) = self.scale_outs.get_mut(request_id).filter(|op| !op.status.is_terminal()) else { return };
        op.error_message = Some(why);
        checked(op.apply(ScaleOutEvent::Fail));
    }

    /// A scale-in the manager's restart interrupted: its victims are removed (the restore drops
    /// them), so it completes.
    pub fn complete_scale_in_after_restart(&mut self, request_id: &str) {
        let Some(op) = self.scale_ins.get_mut(request_id).filter(|op| !op.status.is_terminal()) else { return };
        op.removed_engines = op.engine_ids.clone();
        op.message = format!("{} (completed after a manager restart)", op.message);
        for event in op.status.events_to_complete() {
            checked(op.apply(event));
        }
    }

    /// Puts back a scale-in read from the store after a restart.
    pub fn restore_scale_in(&mut self, record: ScaleInRecord) {
        self.scale_ins.insert(record.request_id.clone(), record);
    }

    /// Frees the one-operation lock (and drops the cancellation token) if `request_id` holds it.
    pub fn end(&mut self, request_id: &str) {
        if self.running.as_ref().is_some_and(|(r, _)| r.request_id == request_id) {
            self.running = None;
        }
    }

    /// Ends operation `request_id` FAILED with `why` if it has not ended (its task stopped
    /// without ending it) and frees its lock: the engines it was adding or removing (the caller
    /// takes back those not serving), or None when it had ended.
    pub fn abandon(&mut self, request_id: &str, why: &str) -> Option<Vec<EngineId>> {
        let engines = if let Some(op) = self.scale_outs.get_mut(request_id).filter(|op| !op.status.is_terminal()) {
            op.error_message = Some(why.to_string());
            checked(op.apply(ScaleOutEvent::Fail));
            Some(op.engine_ids.clone())
        } else if let Some(op) = self.scale_ins.get_mut(request_id).filter(|op| !op.status.is_terminal()) {
            op.error_message = Some(why.to_string());
            checked(op.apply(ScaleInEvent::Fail));
            Some(op.engine_ids.clone())
        } else {
            None
        };
        self.end(request_id);
        engines
    }

    pub fn scale_out(&self, request_id: &str) -> Option<&ScaleOutRecord> {
        self.scale_outs.get(request_id)
    }

    /// A PENDING scale-out's engines are all placed: it starts (`start`: LAUNCHING, or
    /// CONNECTING for external engines). False, nothing changed, when it is not PENDING (it was
    /// cancelled before it started, or started already).
    pub fn scale_out_started(&mut self, request_id: &str, start: ScaleOutEvent) -> bool {
        let Some(op) = self.scale_outs.get_mut(request_id) else { return false };
        op.status == ScaleOutStatus::Pending && op.apply(start).is_ok()
    }

    /// A scale-out follows its slowest engine forward to `phase` (never back).
    pub fn scale_out_reached(&mut self, request_id: &str, phase: Phase) {
        if let Some(op) = self.scale_outs.get_mut(request_id) {
            op.advance_to(phase);
        }
    }

    /// A scale-out says it waits for resources (Ray mode places each engine first; the caller
    /// asks while the operation is PENDING).
    pub fn scale_out_waits_for_resources(&mut self, request_id: &str) {
        if let Some(op) = self.scale_outs.get_mut(request_id) {
            op.message = format!(
                "{}; waiting for resources (PENDING_RESOURCES): the Ray shim places each engine and binds its agent",
                op.message
            );
        }
    }

    /// Ends scale-out `request_id` with `event` (ACTIVATED: caught up to READY first, the
    /// slowest engines may have been dropped), recording the engines that failed and the
    /// message, and frees the one-operation lock.
    pub fn conclude_scale_out(
        &mut self,
        request_id: &str,
        start: ScaleOutEvent,
        event: ScaleOutEvent,
        message: Option<String>,
        failed: &[FailedEngine],
    ) {
        if let Some(op) = self.scale_outs.get_mut(request_id) {
            op.failed_engines = failed.to_vec();
            op.error_message = message;
            if event == ScaleOutEvent::Activated {
                if op.status == ScaleOutStatus::Pending {
                    checked(op.apply(start));
                }
                op.advance_to(Phase::Ready);
            }
            if let Err(e) = op.apply(event) {
                tracing::error!(%e, "scale_out");
            }
        }
        self.end(request_id);
    }

    pub fn scale_in(&self, request_id: &str) -> Option<&ScaleInRecord> {
        self.scale_ins.get(request_id)
    }

    /// What a running scale-in waits for now.
    pub fn scale_in_says(&mut self, request_id: &str, message: String) {
        if let Some(op) = self.scale_ins.get_mut(request_id) {
            op.message = message;
        }
    }

    /// A scale-in's victims are drained (idle, or their requests aborted at the timeout).
    pub fn scale_in_drained(&mut self, request_id: &str) {
        if let Some(op) = self.scale_ins.get_mut(request_id) {
            checked(op.apply(ScaleInEvent::Drained));
        }
    }

    /// Ends scale-in `request_id` with its victims removed (each process reaped) and frees the
    /// one-operation lock.
    pub fn conclude_scale_in(&mut self, request_id: &str, removed: impl IntoIterator<Item = EngineId>) {
        if let Some(op) = self.scale_ins.get_mut(request_id) {
            op.removed_engines.extend(removed);
            checked(op.apply(ScaleInEvent::Removed));
        }
        self.end(request_id);
    }

    /// Every scale-out, in id order.
    pub fn scale_outs(&self) -> impl Iterator<Item = &ScaleOutRecord> {
        self.scale_outs.values()
    }

    /// Every scale-in, in id order.
    pub fn scale_ins(&self) -> impl Iterator<Item = &ScaleInRecord> {
        self.scale_ins.values()
    }

    /// The records the store keeps.
    pub(in crate::registry) fn rows(&self) -> (&BTreeMap<OpId, ScaleOutRecord>, &BTreeMap<OpId, ScaleInRecord>) {
        (&self.scale_outs, &self.scale_ins)
    }

    /// Forgets the oldest finished operations beyond `keep` of each kind, so a long run (an
    /// autoscaler acting for days) holds a bounded history in memory and in the store.
    pub fn prune(&mut self, keep: usize) {
        fn prune<R>(ops: &mut BTreeMap<OpId, R>, keep: usize, finished: impl Fn(&R) -> bool, at: impl Fn(&R) -> f64) {
            if ops.len() <= keep {
                return;
            }
            let mut done: Vec<(f64, OpId)> =
                ops.iter().filter(|(_, r)| finished(r)).map(|(k, r)| (at(r), k.clone())).collect();
            done.sort_by(|a, b| a.0.total_cmp(&b.0));
            let excess = ops.len() - keep;
            for (_, k) in done.into_iter().take(excess) {
                ops.remove(&k);
            }
        }
        prune(&mut self.scale_outs, keep, |r| r.status.is_terminal(), |r| r.created_at);
        prune(&mut self.scale_ins, keep, |r| r.status.is_terminal(), |r| r.created_at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::foundation::records::Trigger;

    fn scale_out(id: &str, status: ScaleOutStatus, at: f64) -> ScaleOutRecord {
        ScaleOutRecord {
            request_id: OpId::parse(id).unwrap(),
            status,
            model_name: "default".into(),
            num_replicas: 1,
            engine_urls: vec![],
            engine_ids: vec![],
            failed_engines: vec![],
            created_at: at,
            updated_at: at,
            error_message: None,
            weight_version: None,
            message: String::new(),
            trigger: Trigger::User,
            history: vec![],
        }
    }

    #[test]
    fn one_operation_runs_and_only_its_holder_frees_the_lock() {
        let mut ops = Operations::default();
        ops.start_scale_out(scale_out("a", ScaleOutStatus::Pending, 1.0)).unwrap();
        assert_eq!(ops.running().map(|r| (r.kind, r.request_id.as_str())), Some(("scale_out", "a")));
        let refused = ops.start_scale_out(scale_out("b", ScaleOutStatus::Pending, 2.0)).unwrap_err();
        assert_eq!(refused.request_id, "a");
        assert!(ops.scale_out("b").is_none(), "a refused operation is not recorded");
        assert!(ops.start_scale_out(scale_out("n", ScaleOutStatus::Noop, 2.0)).is_err(), "not even a NOOP");
        ops.end("b");
        assert!(ops.running().is_some(), "only the holder frees the lock");
        let token = ops.cancel_token("a").unwrap();
        assert!(!ops.cancel("b") && !token.is_cancelled(), "only the running operation is cancelled");
        assert!(ops.cancel("a") && token.is_cancelled());
        ops.end("a");
        assert!(ops.cancel_token("a").is_none() && !ops.cancel("a"), "an ended operation has no token");
        ops.start_scale_out(scale_out("n", ScaleOutStatus::Noop, 3.0)).unwrap();
        assert!(ops.running().is_none() && ops.scale_out("n").is_some(), "a NOOP is recorded, takes no lock");
        ops.restore_scale_out(scale_out("r", ScaleOutStatus::Pending, 4.0));
        assert!(ops.running().is_none(), "a record read back after a restart takes no lock");
    }

    #[test]
    fn an_abandoned_operation_ends_failed_and_frees_the_lock() {
        let mut ops = Operations::default();
        let mut record = scale_out("a", ScaleOutStatus::Pending, 1.0);
        record.engine_ids = vec![EngineId::of_seq(1)];
        ops.start_scale_out(record).unwrap();
        assert_eq!(ops.abandon("a", "task died"), Some(vec![EngineId::of_seq(1)]));
        let a = ops.scale_out("a").unwrap();
        assert_eq!((a.status, a.error_message.as_deref()), (ScaleOutStatus::Failed, Some("task died")));
        assert!(ops.running().is_none());
        assert_eq!(ops.abandon("a", "again"), None, "an ended operation is left as it is");
        assert_eq!(ops.scale_out("a").unwrap().error_message.as_deref(), Some("task died"));
    }

    #[test]
    fn a_scale_out_starts_only_from_pending_and_concludes_after_catching_up() {
        let mut ops = Operations::default();
        ops.start_scale_out(scale_out("a", ScaleOutStatus::Pending, 1.0)).unwrap();
        ops.scale_out_waits_for_resources("a");
        assert!(ops.scale_out("a").unwrap().message.contains("PENDING_RESOURCES"));
        assert!(ops.scale_out_started("a", ScaleOutEvent::StartCreating));
        assert!(!ops.scale_out_started("a", ScaleOutEvent::StartCreating), "started once");
        ops.scale_out_reached("a", Phase::HealthChecking);
        let status = ops.scale_out("a").unwrap().status;
        ops.scale_out_reached("a", Phase::Launching);
        assert_eq!(ops.scale_out("a").unwrap().status, status, "never back");
        ops.conclude_scale_out("a", ScaleOutEvent::StartCreating, ScaleOutEvent::Activated, None, &[]);
        let a = ops.scale_out("a").unwrap();
        assert_eq!(a.status, ScaleOutStatus::Active);
        assert!(a.history.iter().any(|t| t.status == ScaleOutStatus::Ready.to_string()), "{:?}", a.history);
        assert!(ops.running().is_none(), "the lock is freed with the end");

        // Every engine ready at once: a PENDING scale-out starts and ends in one step.
        ops.start_scale_out(scale_out("b", ScaleOutStatus::Pending, 2.0)).unwrap();
        ops.conclude_scale_out("b", ScaleOutEvent::StartCreating, ScaleOutEvent::Activated, None, &[]);
        assert_eq!(ops.scale_out("b").unwrap().status, ScaleOutStatus::Active);
        // A cancelled one does not start.
        ops.start_scale_out(scale_out("c", ScaleOutStatus::Pending, 3.0)).unwrap();
        ops.conclude_scale_out("c", ScaleOutEvent::StartCreating, ScaleOutEvent::Cancel, Some("cancelled".into()), &[]);
        assert!(!ops.scale_out_started("c", ScaleOutEvent::StartCreating));
        assert_eq!(ops.scale_out("c").unwrap().status, ScaleOutStatus::Cancelled);
    }

    #[test]
    fn prunes_only_the_oldest_finished_operations() {
        let mut ops = Operations::default();
        for i in 0..5 {
            let status = if i == 0 { ScaleOutStatus::Pending } else { ScaleOutStatus::Active };
            ops.restore_scale_out(scale_out(&format!("op{i}"), status, f64::from(i)));
        }
        ops.prune(3);
        let left: Vec<_> = ops.scale_outs().map(|r| r.request_id.as_str()).collect();
        // The running op0 stays although it is the oldest; op1 and op2 go.
        assert_eq!(left, vec!["op0", "op3", "op4"]);
    }
}
