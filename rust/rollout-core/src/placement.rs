//! Placement of engines: on the local pool of GPUs, or as Ray placements.
//!
//! Local (`--placement local`): the pool hands out GPU indices; an engine of tensor-parallel
//! size K takes K of them. The lowest free indices are used first, and a block of consecutive
//! indices is preferred so that a TP group shares a switch when the machine has one.
//!
//! Ray (`--placement ray`): every managed engine gets a [`Placement`], the manager's decision of
//! what the Ray shim must create for it (one bundle with the engine's K GPUs, STRICT_PACK so an
//! engine's TP ranks share a node) and whether it should exist. The shim reports back by binding
//! an agent. The lifecycle is `PENDING_RESOURCES -> BOUND` while desired present (back to
//! `PENDING_RESOURCES` when the bound agent is lost), then
//! `RELEASING` once the manager no longer wants it (the shim removes it and says released).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Whether the manager wants a placement to exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Desired {
    Present,
    Absent,
}

/// Where a placement stands, as the shim and operators see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PlacementStatus {
    /// Wanted, no agent bound yet (Ray is finding or growing resources).
    PendingResources,
    /// An agent hosts (or will host) the engine.
    Bound,
    /// No longer wanted; the shim removes its placement group and reports it released.
    Releasing,
}

/// The agent a placement is bound to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AgentBinding {
    /// gRPC URL of the agent, `http://<node_ip>:<port>`.
    pub url: String,
    pub node_id: String,
    /// GPU ids Ray assigned to the engine's actor (its `CUDA_VISIBLE_DEVICES`).
    pub gpu_ids: Vec<String>,
}

/// One engine's placement in Ray mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Placement {
    pub engine_id: crate::ids::EngineId,
    /// Resources of the engine's placement group, one map per bundle.
    pub bundles: Vec<BTreeMap<String, u32>>,
    pub strategy: String,
    /// Part of the start-up fleet (`--rollout-num-gpus`) rather than a scale-out.
    pub initial: bool,
    pub desired: Desired,
    pub status: PlacementStatus,
    pub agent: Option<AgentBinding>,
    pub labels: BTreeMap<String, String>,
}

/// What a bind did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindOutcome {
    /// The placement was pending and is now bound.
    Bound,
    /// Already bound to this agent: nothing changed.
    Same,
    /// It was bound to another agent, which is replaced.
    Replaced { previous: AgentBinding },
}

/// What reporting an agent lost did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoseOutcome {
    /// The placement was bound to that agent and is unbound now: PENDING_RESOURCES again while
    /// it is wanted (the shim places it anew), still RELEASING when it is not.
    Unbound { previous: AgentBinding },
    /// The placement is not bound to that agent (already unbound, or re-bound to another one):
    /// a late or repeated report, which changes nothing.
    Stale,
}

/// Why a bind or release was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementConflict {
    #[error("placement {0} is no longer wanted (desired absent); remove its placement group and POST released")]
    NotWanted(crate::ids::EngineId),
    #[error("placement {engine_id} is bound to another live agent {url}")]
    BoundElsewhere { engine_id: crate::ids::EngineId, url: String },
    #[error("placement {0} is still wanted (desired present); scale in first")]
    StillWanted(crate::ids::EngineId),
}

impl Placement {
    /// The plan for one engine of `gpus_per_engine` GPUs: one bundle holding all its GPUs and a
    /// CPU, packed on one node.
    pub fn plan(engine_id: &crate::ids::EngineId, gpus_per_engine: u32, initial: bool) -> Self {
        let bundle = BTreeMap::from([("GPU".to_string(), gpus_per_engine), ("CPU".to_string(), 1)]);
        Self {
            engine_id: engine_id.clone(),
            bundles: vec![bundle],
            strategy: "STRICT_PACK".into(),
            initial,
            desired: Desired::Present,
            status: PlacementStatus::PendingResources,
            agent: None,
            labels: BTreeMap::new(),
        }
    }

    /// Binds an agent. `previous_live` says whether a different agent already bound is still
    /// reachable (only asked when there is one): a live one is never replaced.
    pub fn bind(&mut self, binding: AgentBinding, previous_live: bool) -> Result<BindOutcome, PlacementConflict> {
        if self.desired == Desired::Absent {
            return Err(PlacementConflict::NotWanted(self.engine_id.clone()));
        }
        let outcome = match &self.agent {
            Some(a) if a.url == binding.url => return Ok(BindOutcome::Same),
            Some(a) if previous_live => {
                return Err(PlacementConflict::BoundElsewhere { engine_id: self.engine_id.clone(), url: a.url.clone() })
            }
            Some(a) => BindOutcome::Replaced { previous: a.clone() },
            None => BindOutcome::Bound,
        };
        self.agent = Some(binding);
        self.status = PlacementStatus::Bound;
        Ok(outcome)
    }

    /// The agent at `agent_url` is gone (its node, host actor or process died). A placement bound
    /// to it loses the binding: a wanted one waits for resources again, so the shim re-places it
    /// and binds a new agent. Reports about any other agent are stale and change nothing.
    pub fn lose(&mut self, agent_url: &str) -> LoseOutcome {
        let Some(previous) = self.agent.take_if(|a| a.url == agent_url) else { return LoseOutcome::Stale };
        self.status = match self.desired {
            Desired::Present => PlacementStatus::PendingResources,
            Desired::Absent => PlacementStatus::Releasing,
        };
        LoseOutcome::Unbound { previous }
    }

    /// The manager no longer wants it (its engine was stopped or never started).
    pub fn unwant(&mut self) {
        self.desired = Desired::Absent;
        self.status = PlacementStatus::Releasing;
    }

    /// Checks that the shim may forget it.
    pub fn check_released(&self) -> Result<(), PlacementConflict> {
        match self.desired {
            Desired::Absent => Ok(()),
            Desired::Present => Err(PlacementConflict::StillWanted(self.engine_id.clone())),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("need {needed} GPUs but only {free} of {total} are free (raise --gpus, or scale in first)")]
    Insufficient { needed: u32, free: u32, total: u32 },
    #[error("GPU {0} is not allocated")]
    NotAllocated(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuPool {
    total: u32,
    used: BTreeSet<u32>,
}

impl GpuPool {
    pub fn new(total: u32) -> Self {
        Self { total, used: BTreeSet::new() }
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn free(&self) -> u32 {
        self.total - self.used.len() as u32
    }

    /// Takes `n` GPUs: a consecutive block when one exists, else the lowest free ones.
    pub fn allocate(&mut self, n: u32) -> Result<Vec<u32>, PlacementError> {
        if n > self.free() {
            return Err(PlacementError::Insufficient { needed: n, free: self.free(), total: self.total });
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let free: Vec<u32> = (0..self.total).filter(|g| !self.used.contains(g)).collect();
        let block = free
            .windows(n as usize)
            .find(|w| w.last().zip(w.first()).is_some_and(|(l, f)| l - f + 1 == n))
            .map(<[u32]>::to_vec);
        let chosen = block.unwrap_or_else(|| free[..n as usize].to_vec());
        self.used.extend(chosen.iter().copied());
        Ok(chosen)
    }

    /// Returns GPUs to the pool. All of them must be allocated; otherwise nothing changes.
    pub fn release(&mut self, gpus: &[u32]) -> Result<(), PlacementError> {
        if let Some(g) = gpus.iter().find(|g| !self.used.contains(g)) {
            return Err(PlacementError::NotAllocated(*g));
        }
        for g in gpus {
            self.used.remove(g);
        }
        Ok(())
    }

    /// Marks specific GPUs as used (when re-adopting engines that already hold them).
    pub fn claim(&mut self, gpus: &[u32]) -> Result<(), PlacementError> {
        if gpus.iter().any(|g| *g >= self.total || self.used.contains(g)) {
            return Err(PlacementError::Insufficient {
                needed: gpus.len() as u32,
                free: self.free(),
                total: self.total,
            });
        }
        self.used.extend(gpus.iter().copied());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocates_lowest_blocks_and_reuses_released() {
        let mut pool = GpuPool::new(4);
        assert_eq!(pool.allocate(1).unwrap(), vec![0]);
        assert_eq!(pool.allocate(2).unwrap(), vec![1, 2]);
        pool.release(&[0]).unwrap();
        // A consecutive block is preferred over the lowest indices.
        let mut pool2 = GpuPool::new(4);
        pool2.claim(&[1]).unwrap();
        assert_eq!(pool2.allocate(2).unwrap(), vec![2, 3]);
        assert_eq!(pool.allocate(1).unwrap(), vec![0]);
        let err = pool.allocate(2).unwrap_err();
        assert_eq!(err, PlacementError::Insufficient { needed: 2, free: 1, total: 4 });
        assert!(err.to_string().contains("--gpus"));
    }

    #[test]
    fn release_of_unallocated_changes_nothing() {
        let mut pool = GpuPool::new(2);
        pool.allocate(1).unwrap();
        assert_eq!(pool.release(&[0, 1]), Err(PlacementError::NotAllocated(1)));
        assert_eq!(pool.free(), 1);
    }

    fn binding(url: &str) -> AgentBinding {
        AgentBinding { url: url.into(), node_id: "n".into(), gpu_ids: vec!["0".into()] }
    }

    #[test]
    fn placement_binds_once_and_replaces_only_a_dead_agent() {
        let mut p = Placement::plan(&crate::ids::EngineId::of_seq(3), 2, false);
        assert_eq!(p.bundles[0].get("GPU"), Some(&2));
        assert_eq!((p.desired, p.status), (Desired::Present, PlacementStatus::PendingResources));
        assert_eq!(p.check_released(), Err(PlacementConflict::StillWanted(crate::ids::EngineId::of_seq(3))));
        assert_eq!(p.bind(binding("http://a:1"), false), Ok(BindOutcome::Bound));
        assert_eq!(p.status, PlacementStatus::Bound);
        assert_eq!(p.bind(binding("http://a:1"), true), Ok(BindOutcome::Same));
        let live = p.bind(binding("http://b:2"), true).unwrap_err();
        assert!(live.to_string().contains("http://a:1"), "{live}");
        assert_eq!(p.agent.as_ref().map(|a| a.url.as_str()), Some("http://a:1"));
        assert_eq!(p.bind(binding("http://b:2"), false), Ok(BindOutcome::Replaced { previous: binding("http://a:1") }));
        p.unwant();
        assert_eq!(p.status, PlacementStatus::Releasing);
        assert!(matches!(p.bind(binding("http://c:3"), false), Err(PlacementConflict::NotWanted(_))));
        assert_eq!(p.check_released(), Ok(()));
        let wire = serde_json::to_value(&p).unwrap();
        assert_eq!(wire["status"], "RELEASING");
        assert_eq!(wire["desired"], "absent");
        assert_eq!(wire["strategy"], "STRICT_PACK");
    }

    #[test]
    fn a_lost_agent_unbinds_only_its_own_placement() {
        // (desired, bound to, reported agent) -> (outcome unbound?, status after, agent after)
        let cases = [
            (Desired::Present, Some("http://a:1"), "http://a:1", true, PlacementStatus::PendingResources, None),
            (Desired::Present, Some("http://a:1"), "http://b:2", false, PlacementStatus::Bound, Some("http://a:1")),
            (Desired::Present, None, "http://a:1", false, PlacementStatus::PendingResources, None),
            (Desired::Absent, Some("http://a:1"), "http://a:1", true, PlacementStatus::Releasing, None),
            (Desired::Absent, None, "http://a:1", false, PlacementStatus::Releasing, None),
        ];
        for (desired, bound, reported, unbound, status, agent) in cases {
            let mut p = Placement::plan(&crate::ids::EngineId::of_seq(1), 1, false);
            if let Some(url) = bound {
                p.bind(binding(url), false).unwrap();
            }
            if desired == Desired::Absent {
                p.unwant();
            }
            let outcome = p.lose(reported);
            let case = format!("{desired:?} bound={bound:?} reported={reported}");
            assert_eq!(matches!(outcome, LoseOutcome::Unbound { .. }), unbound, "{case}");
            if let LoseOutcome::Unbound { previous } = &outcome {
                assert_eq!(previous.url, reported, "{case}");
            }
            assert_eq!(p.status, status, "{case}");
            assert_eq!(p.agent.as_ref().map(|a| a.url.as_str()), agent, "{case}");
            assert_eq!(p.desired, desired, "{case}");
            // Reporting the same loss again changes nothing.
            let before = p.clone();
            assert_eq!(p.lose(reported), LoseOutcome::Stale, "{case}");
            assert_eq!(p, before, "{case}");
        }
        // A lost placement binds a new agent as a fresh one would.
        let mut p = Placement::plan(&crate::ids::EngineId::of_seq(1), 1, false);
        p.bind(binding("http://a:1"), false).unwrap();
        p.lose("http://a:1");
        assert_eq!(p.bind(binding("http://b:2"), false), Ok(BindOutcome::Bound));
        assert_eq!(p.status, PlacementStatus::Bound);
    }

    proptest! {
        #[test]
        fn never_double_allocates(ops in proptest::collection::vec((any::<bool>(), 0u32..4), 0..40)) {
            let mut pool = GpuPool::new(8);
            let mut held: Vec<Vec<u32>> = Vec::new();
            for (alloc, n) in ops {
                if alloc {
                    if let Ok(g) = pool.allocate(n) {
                        prop_assert_eq!(g.len() as u32, n);
                        for x in &g {
                            prop_assert!(held.iter().all(|h| !h.contains(x)));
                        }
                        held.push(g);
                    }
                } else if let Some(g) = held.pop() {
                    prop_assert!(pool.release(&g).is_ok());
                }
                let used: u32 = held.iter().map(|h| h.len() as u32).sum();
                prop_assert_eq!(pool.free(), 8 - used);
            }
        }
    }
}
