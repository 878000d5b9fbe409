//! `/health` and `/health_generate`: SGLang's health generation (0.5.23
//! `entrypoints/http_server.py:721-800`).
//!
//! Expected flow: a 1-token request (`input_ids [0]`, temperature 0, rid
//! `HEALTH_CHECK_<uuid>`, not counted in metrics or by the request faults) goes through the
//! `/generate` path, so it waits while generation is paused and while a weight update holds the
//! model lock. The check looks once a second (scaled by `--time-scale`, like every engine
//! timing here) whether the schedulers sent anything since the call: any request's output, an
//! abort, or a reply to a control call (SGLang's `last_receive_tstamp` moves on every message,
//! `managers/tokenizer_manager.py:2465-2478`). The first look that finds one passes the check,
//! so even an idle engine answers only after one look (about 1 s unscaled).
//!
//! Guarantees: a check that finds nothing before `SGLANG_HEALTH_CHECK_TIMEOUT` wall-clock
//! seconds fails; a failure marks the server `UnHealthy` and a later pass `Up` again, even when
//! the client gave up first (the check runs in a task of its own). The health request itself
//! keeps running when the check ends, as SGLang's does (it forgets the rid, it does not abort).

use crate::engine::{Engine, NewRequestParts, Status};
use std::sync::Arc;
use std::time::Duration;

/// SGLang looks at the last scheduler message once a second (`await asyncio.sleep(1)`).
const LOOK_INTERVAL: Duration = Duration::from_secs(1);

/// SGLang's health-check settings, read from the environment at startup as SGLang reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthSettings {
    /// `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` (default true; `true/1/yes/y`,
    /// `false/0/no/n`, any case; another value warns and keeps the default): false makes
    /// `/health` (not `/health_generate`) answer 200 without a generation.
    pub generation: bool,
    /// `SGLANG_HEALTH_CHECK_TIMEOUT`: integer wall-clock seconds (default 20; never scaled by
    /// `--time-scale`); 0 or less fails every check at once. SGLang refuses to start on a
    /// value that is not an integer; the simulator warns and keeps 20.
    pub timeout_secs: i64,
}

impl HealthSettings {
    pub const DEFAULT_TIMEOUT_SECS: i64 = 20;

    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok();
        Self::parse(
            var("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION").as_deref(),
            var("SGLANG_HEALTH_CHECK_TIMEOUT").as_deref(),
        )
    }

    pub fn parse(generation: Option<&str>, timeout: Option<&str>) -> Self {
        let generation = match generation.map(str::to_ascii_lowercase).as_deref() {
            None | Some("true" | "1" | "yes" | "y") => true,
            Some("false" | "0" | "no" | "n") => false,
            Some(other) => {
                tracing::warn!(value = other, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is not a boolean; using true");
                true
            }
        };
        let timeout_secs = match timeout.map(|t| t.trim().parse::<i64>()) {
            None => Self::DEFAULT_TIMEOUT_SECS,
            Some(Ok(t)) => t,
            Some(Err(_)) => {
                tracing::warn!(value = timeout, "SGLANG_HEALTH_CHECK_TIMEOUT is not an integer; using 20");
                Self::DEFAULT_TIMEOUT_SECS
            }
        };
        Self { generation, timeout_secs }
    }
}

/// When the check looking every `look` passes, if the first scheduler message after the call
/// arrives `after` it: at the first look at or after it (never before the first look). `None`:
/// no look within `timeout` sees it. A zero `look` (time scale 0) sees a message at once.
pub fn passes_at(after: Duration, look: Duration, timeout: Duration) -> Option<Duration> {
    if look.is_zero() {
        return (after <= timeout).then_some(after);
    }
    let looks = last_look(look, timeout);
    let k = (after.as_secs_f64() / look.as_secs_f64()).ceil().max(1.0);
    (k <= looks).then(|| look.mul_f64(k))
}

/// How many looks SGLang's loop makes (`while now < tic + timeout: sleep(look); check`).
fn last_look(look: Duration, timeout: Duration) -> f64 {
    (timeout.as_secs_f64() / look.as_secs_f64()).ceil()
}

impl Engine {
    /// Runs one health check (see the module docs); true if it passed.
    pub async fn health_generate(self: &Arc<Self>) -> bool {
        let engine = self.clone();
        let check = tokio::spawn(async move { engine.run_health_check().await });
        check.await.unwrap_or(false)
    }

    async fn run_health_check(self: Arc<Self>) -> bool {
        let timeout_secs = self.health.timeout_secs;
        let mut outputs = self.shared.watch_outputs();
        let started = tokio::time::Instant::now();
        let timeout = Duration::from_secs(u64::try_from(timeout_secs).unwrap_or(0));
        let look = LOOK_INTERVAL.mul_f64(self.cfg.time_scale);
        // A message after this instant passes no look.
        let horizon = if look.is_zero() { timeout } else { look.mul_f64(last_look(look, timeout)) };
        let probe = tokio::spawn(self.clone().send_health_request());
        let heard = timeout_secs > 0
            && tokio::select! {
                changed = outputs.changed() => changed.is_ok(),
                () = tokio::time::sleep_until(started + horizon) => false,
            };
        let passed = heard
            && match passes_at(started.elapsed(), look, timeout) {
                Some(at) => {
                    tokio::time::sleep_until(started + at).await;
                    true
                }
                None => false,
            };
        // Like SGLang's `task.cancel()`: a request still waiting to be sent is dropped; one
        // already sent runs on (see `send_health_request`).
        probe.abort();
        if passed {
            self.shared.transition(Status::UnHealthy, Status::Up);
        } else if self.shared.status() != Status::ShuttingDown {
            tracing::error!(
                port = self.port,
                "Health check failed. Server couldn't get a response from detokenizer for last {timeout_secs} seconds."
            );
            self.shared.transition(Status::Up, Status::UnHealthy);
        }
        passed
    }

    /// The health check's own request: through the `/generate` path's waits, then to one DP
    /// rank. Once submitted it is detached, so ending the check does not abort it; like
    /// SGLang's, whose `generate_request` holds the model-update lock until the check cancels it
    /// (`managers/tokenizer_manager.py:937-955`), this task holds the lock until the check ends
    /// (it is aborted then), so a weight update never starts under a health request just sent.
    async fn send_health_request(self: Arc<Self>) {
        if self.shared.is_scheduler_hung() {
            return;
        }
        let rid = format!("HEALTH_CHECK_{}", uuid::Uuid::new_v4().simple());
        let live = self.register_rid(&rid);
        self.shared.wait_unpaused().await;
        if self.shared.status() == Status::ShuttingDown {
            return;
        }
        let _guard = self.model_update_lock.clone().read_owned().await;
        if self.cfg.zero_cost {
            // Generation answers without a scheduler: that is the message the check hears.
            self.shared.note_output();
            return std::future::pending().await;
        }
        let params = crate::sampling::RawSamplingParams {
            max_new_tokens: Some(Some(1)),
            temperature: Some(0.0),
            ..Default::default()
        }
        .validate();
        if let Ok(params) = params {
            let prompt = vec![0];
            let gen = crate::generator::GenState::new(&prompt, &params, crate::generator::GREEDY, 1, 0.0);
            let parts = NewRequestParts { rid, prompt, gen, stream: false, stream_interval: None };
            self.submit(self.pick_rank(None), parts, live).detach();
        }
        std::future::pending().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_check_passes_at_the_first_look_after_a_message() {
        let s = Duration::from_secs_f64;
        let (look, timeout) = (s(1.0), s(20.0));
        // An idle engine's own 1-token output comes fast, yet the check answers at the first look.
        assert_eq!(passes_at(s(0.01), look, timeout), Some(s(1.0)));
        assert_eq!(passes_at(s(2.5), look, timeout), Some(s(3.0)));
        assert_eq!(passes_at(s(19.5), look, timeout), Some(s(20.0)));
        assert_eq!(passes_at(s(20.5), look, timeout), None);
        // Scaled by --time-scale 0.01: a look every 10 ms.
        assert_eq!(passes_at(s(0.001), s(0.01), timeout), Some(s(0.01)));
        // Time scale 0: at once.
        assert_eq!(passes_at(s(0.003), Duration::ZERO, timeout), Some(s(0.003)));
    }

    #[test]
    fn settings_read_like_sglang() {
        assert_eq!(HealthSettings::parse(None, None), HealthSettings { generation: true, timeout_secs: 20 });
        assert_eq!(
            HealthSettings::parse(Some("No"), Some(" 3 ")),
            HealthSettings { generation: false, timeout_secs: 3 }
        );
        assert_eq!(HealthSettings::parse(Some("maybe"), Some("x")).timeout_secs, 20);
    }
}
