//! Unit tests of the scheduler core: no async loop, steps are planned and completed by hand.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::sampling::RawSamplingParams;
use serde_json::json;

fn cfg(capacity: usize) -> RankConfig {
    RankConfig {
        capacity,
        max_running: 64,
        chunked_prefill_size: 8192,
        cache_enabled: true,
        time_scale: 0.0,
        prefill_base_ms: 1.0,
        prefill_ms_per_1k_tokens: 10.0,
        decode_step_base_ms: 1.0,
        decode_step_ms_per_req: 0.1,
        decode_step_ms_per_1k_ctx: 0.0,
    }
}

fn request(core: &mut Core, prompt: Vec<u32>, max_new: u32) -> (u64, mpsc::UnboundedReceiver<Update>) {
    let params = RawSamplingParams::from_value(json!({"ignore_eos": true})).unwrap().validate().unwrap();
    let gen = GenState::new(&prompt, &params, 0, max_new, 0.0);
    let (tx, rx) = mpsc::unbounded_channel();
    let key = core.enqueue(NewRequest { rid: format!("r{}", core.next_key), prompt, gen, stream: false, tx });
    (key, rx)
}

/// Runs steps until nothing is left to do; returns how many steps ran.
fn drain(core: &mut Core, cfg: &RankConfig) -> usize {
    let v = VersionInfo::new("v");
    let mut steps = 0;
    while let Some(plan) = core.plan(cfg) {
        core.complete(&plan, &v, Instant::now());
        steps += 1;
        assert!(steps < 100_000, "scheduler does not make progress");
    }
    steps
}

fn finished(rx: &mut mpsc::UnboundedReceiver<Update>) -> Box<Finished> {
    loop {
        match rx.try_recv().expect("request did not finish") {
            Update::Finished(f) => return f,
            Update::Tokens { .. } => {}
        }
    }
}

#[test]
fn one_request_runs_to_length_and_frees_its_kv() {
    let c = cfg(1000);
    let mut core = Core::new(&c);
    let (_, mut rx) = request(&mut core, (0..40).collect(), 10);
    let steps = drain(&mut core, &c);
    assert_eq!(steps, 10, "one prefill step gives the first token, then 9 decode steps");
    let f = finished(&mut rx);
    assert_eq!(f.reason, FinishReason::Length(10));
    assert_eq!(f.gen.output.len(), 10);
    assert_eq!(f.cached_tokens, 0);
    assert!(core.is_idle());
    assert_eq!(core.pool.used(), 0);
    // 40 prompt + 9 output tokens hold KV: 3 full blocks are cached.
    assert_eq!(core.pool.cached_tokens(), 48);
}

#[test]
fn shared_prefix_is_reported_as_cached() {
    let c = cfg(1000);
    let mut core = Core::new(&c);
    let prompt: Vec<u32> = (100..200).collect();
    let (_, mut rx1) = request(&mut core, prompt.clone(), 4);
    drain(&mut core, &c);
    assert_eq!(finished(&mut rx1).cached_tokens, 0);
    let (_, mut rx2) = request(&mut core, prompt, 4);
    drain(&mut core, &c);
    assert_eq!(finished(&mut rx2).cached_tokens, 96);
}

#[test]
fn queue_waits_for_room_and_everything_finishes() {
    let c = cfg(300);
    let mut core = Core::new(&c);
    let mut rxs = Vec::new();
    for i in 0..10u32 {
        rxs.push(request(&mut core, vec![i * 1000 + 1; 100], 50).1);
    }
    let plan = core.plan(&c).unwrap();
    assert_eq!(plan.kind, StepKind::Prefill);
    assert!(plan.batch.len() < 10, "the pool cannot hold every prompt at once");
    assert!(!core.waiting.is_empty());
    core.complete(&plan, &VersionInfo::new("v"), Instant::now());
    drain(&mut core, &c);
    for rx in &mut rxs {
        assert_eq!(finished(rx).reason, FinishReason::Length(50));
    }
    assert_eq!(core.pool.used(), 0);
}

#[test]
fn decode_out_of_room_retracts_and_recovers() {
    let mut c = cfg(400);
    c.chunked_prefill_size = 100_000;
    let mut core = Core::new(&c);
    // Make admission optimistic so the batch outgrows the pool while decoding.
    core.new_token_ratio = 0.0;
    let mut rxs = Vec::new();
    for i in 0..4u32 {
        rxs.push(request(&mut core, vec![i + 7; 60], 200).1);
    }
    let v = VersionInfo::new("v");
    let plan = core.plan(&c).unwrap();
    assert_eq!(plan.batch.len(), 4);
    core.complete(&plan, &v, Instant::now());
    core.new_token_ratio = 0.0;
    drain(&mut core, &c);
    let mut retractions = 0;
    for rx in &mut rxs {
        let f = finished(rx);
        assert_eq!(f.gen.output.len(), 200);
        retractions += f.retractions;
    }
    assert!(retractions > 0);
    assert_eq!(core.pool.used(), 0);
}

#[test]
fn abort_frees_kv_and_reports_abort() {
    let c = cfg(1000);
    let mut core = Core::new(&c);
    let (k1, mut rx1) = request(&mut core, vec![5; 40], 100);
    let (_, mut rx2) = request(&mut core, vec![6; 40], 3);
    let plan = core.plan(&c).unwrap();
    core.complete(&plan, &VersionInfo::new("v"), Instant::now());
    assert!(core.finish(k1, FinishReason::Abort("stop".into())));
    assert!(!core.finish(k1, FinishReason::Abort("again".into())));
    assert!(finished(&mut rx1).reason.is_abort());
    drain(&mut core, &c);
    assert_eq!(finished(&mut rx2).reason, FinishReason::Length(3));
    assert_eq!(core.pool.used(), 0);
}

#[test]
fn decode_cost_grows_with_batch_size() {
    let c = cfg(10_000);
    let mut core = Core::new(&c);
    let _rx: Vec<_> = (0..20u32).map(|i| request(&mut core, vec![i; 8], 50).1).collect();
    let v = VersionInfo::new("v");
    let prefill = core.plan(&c).unwrap();
    core.complete(&prefill, &v, Instant::now());
    let big = core.plan(&c).unwrap();
    assert_eq!(big.kind, StepKind::Decode);

    let mut small_core = Core::new(&c);
    let _rx2 = request(&mut small_core, vec![1; 8], 50);
    let p = small_core.plan(&c).unwrap();
    small_core.complete(&p, &v, Instant::now());
    let small = small_core.plan(&c).unwrap();
    assert!(big.cost > small.cost);
}
