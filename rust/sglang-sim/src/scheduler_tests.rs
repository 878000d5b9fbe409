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
        stream_rule: StreamRule::Unsent,
        stream_interval: 1,
    }
}

fn request(core: &mut Core, prompt: Vec<u32>, max_new: u32) -> (u64, mpsc::UnboundedReceiver<Update>) {
    submit(core, prompt, max_new, false, None)
}

fn submit(
    core: &mut Core,
    prompt: Vec<u32>,
    max_new: u32,
    stream: bool,
    stream_interval: Option<i64>,
) -> (u64, mpsc::UnboundedReceiver<Update>) {
    let params = RawSamplingParams::from_value(json!({"ignore_eos": true})).unwrap().validate().unwrap();
    let gen = GenState::new(&prompt, &params, crate::generator::GREEDY, max_new, 0.0);
    let (tx, rx) = mpsc::unbounded_channel();
    let rid = format!("r{}", core.next_key);
    let key = core.enqueue(NewRequest { rid, prompt, gen, stream, stream_interval, tx }, 1);
    (key, rx)
}

/// Plans and completes one step.
fn step(core: &mut Core, c: &RankConfig) -> StepKind {
    let plan = core.plan(c).expect("a step to run");
    core.complete(&plan, &VersionInfo::new("v"), Instant::now(), c);
    plan.kind
}

/// The lengths of the outputs sent so far in `Tokens` updates, and the final update if any.
fn updates(rx: &mut mpsc::UnboundedReceiver<Update>) -> (Vec<usize>, Option<Box<Finished>>) {
    let (mut lens, mut total) = (Vec::new(), 0);
    while let Ok(u) = rx.try_recv() {
        match u {
            Update::Tokens { ids, .. } => {
                total += ids.len();
                lens.push(total);
            }
            Update::Finished(f) => return (lens, Some(f)),
        }
    }
    (lens, None)
}

/// Runs steps until nothing is left to do; returns how many steps ran.
fn drain(core: &mut Core, cfg: &RankConfig) -> usize {
    let v = VersionInfo::new("v");
    let mut steps = 0;
    while let Some(plan) = core.plan(cfg) {
        core.complete(&plan, &v, Instant::now(), cfg);
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
    assert!(core.is_fully_idle(false));
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
    core.complete(&plan, &VersionInfo::new("v"), Instant::now(), &c);
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
    core.complete(&plan, &v, Instant::now(), &c);
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
    core.complete(&plan, &VersionInfo::new("v"), Instant::now(), &c);
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
    core.complete(&prefill, &v, Instant::now(), &c);
    let big = core.plan(&c).unwrap();
    assert_eq!(big.kind, StepKind::Decode);

    let mut small_core = Core::new(&c);
    let _rx2 = request(&mut small_core, vec![1; 8], 50);
    let p = small_core.plan(&c).unwrap();
    small_core.complete(&p, &v, Instant::now(), &c);
    let small = small_core.plan(&c).unwrap();
    assert!(big.cost > small.cost);
}

/// An abort reaches a running request as a mark: the next step still gives it a token, then it
/// ends with SGLang's running-abort reason; the tokens already made stay.
#[test]
fn a_running_request_aborted_gets_one_more_token() {
    let c = cfg(1000);
    let mut core = Core::new(&c);
    let (k, mut rx) = request(&mut core, vec![5; 8], 100);
    step(&mut core, &c);
    step(&mut core, &c);
    core.abort(k);
    assert!(updates(&mut rx).1.is_none(), "not ended by the abort itself");
    step(&mut core, &c);
    let f = updates(&mut rx).1.expect("ended after one more step");
    assert_eq!(f.reason, FinishReason::Abort("Aborted".into()));
    assert_eq!(f.gen.output.len(), 3);
    assert_eq!(
        f.reason.to_json(),
        json!({"type": "abort", "message": "Aborted", "status_code": null, "err_type": null})
    );
}

/// An abort that arrives while a step runs does not end the request in that step: the step's
/// token counts as made before the abort, and one more step follows.
#[test]
fn an_abort_during_a_step_ends_the_request_after_the_next() {
    let c = cfg(1000);
    let mut core = Core::new(&c);
    let (k, mut rx) = request(&mut core, vec![5; 8], 100);
    step(&mut core, &c);
    let in_flight = core.plan(&c).unwrap();
    core.abort(k);
    core.complete(&in_flight, &VersionInfo::new("v"), Instant::now(), &c);
    assert!(updates(&mut rx).1.is_none());
    step(&mut core, &c);
    let f = updates(&mut rx).1.expect("ended");
    assert_eq!(f.gen.output.len(), 3);
    assert!(f.reason.is_abort());
}

/// A waiting request ends at once with the tokenizer's answer, made of what had been sent: a
/// retracted non-streaming request keeps its output up to the last multiple of 50 tokens, a
/// stream what it streamed.
#[test]
fn an_abort_in_the_waiting_queue_answers_with_what_was_sent() {
    let c = cfg(10_000);
    let mut core = Core::new(&c);
    let (plain, mut plain_rx) = request(&mut core, vec![5; 8], 500);
    let (streamed, mut stream_rx) = submit(&mut core, vec![6; 8], 500, true, Some(4));
    for _ in 0..123 {
        step(&mut core, &c);
    }
    // What pause_generation(retract) does.
    for key in std::mem::take(&mut core.running).into_iter().rev() {
        core.retract(key);
        core.waiting.push_front(key);
    }
    let (queued, mut queued_rx) = request(&mut core, vec![7; 8], 500);
    for key in [plain, streamed, queued] {
        core.abort(key);
    }
    let f = updates(&mut plain_rx).1.unwrap();
    assert_eq!(f.reason, FinishReason::WaitingAbort("Abort in waiting queue".into()));
    assert_eq!(f.reason.to_json(), json!({"type": "abort", "message": "Abort in waiting queue"}));
    assert_eq!(f.gen.output.len(), 100, "sent at 50 and 100 of 123");
    assert_eq!(f.gen.spans.last().unwrap().end, 100);
    let (lens, f) = updates(&mut stream_rx);
    assert_eq!(lens.last(), Some(&121), "1, 5, ..., 121 sent of 123");
    assert_eq!(f.unwrap().gen.output.len(), 121);
    assert_eq!(updates(&mut queued_rx).1.unwrap().gen.output.len(), 0);
    assert!(core.is_fully_idle(false));
}

/// A stream sends its first token at once, then whenever `stream_interval` tokens are unsent;
/// the end sends the rest.
#[test]
fn a_stream_sends_by_its_interval() {
    let c = cfg(10_000);
    let mut core = Core::new(&c);
    let (_, mut every) = submit(&mut core, vec![5; 8], 10, true, None);
    let (_, mut fourth) = submit(&mut core, vec![6; 8], 10, true, Some(4));
    let (_, mut plain) = request(&mut core, vec![7; 8], 10);
    drain(&mut core, &c);
    let (lens, f) = updates(&mut every);
    assert_eq!(lens, (1..=9).collect::<Vec<_>>());
    assert_eq!(f.unwrap().gen.output.len(), 10);
    assert_eq!(updates(&mut fourth).0, vec![1, 5, 9]);
    assert!(updates(&mut plain).0.is_empty());
}

/// Waiting requests keep the rank from being idle (no flush) unless the scheduler is paused;
/// running ones always do.
#[test]
fn idle_means_nothing_running_and_nothing_waiting_unless_paused() {
    let c = cfg(10_000);
    let mut core = Core::new(&c);
    let (k, _rx) = request(&mut core, vec![5; 8], 100);
    assert!(!core.is_fully_idle(false));
    assert!(core.is_fully_idle(true));
    step(&mut core, &c);
    assert!(!core.is_fully_idle(true));
    core.retract(k);
    core.running.clear();
    core.waiting.push_front(k);
    assert!(!core.is_fully_idle(false), "a retracted request is still waiting");
    assert!(core.is_fully_idle(true));
}
