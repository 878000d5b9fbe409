//! `rollout-manager monitor --url http://127.0.0.1:8000`: a live terminal view of the fleet
//! and the autoscaler, redrawn in place every `--interval-secs`; `q` (or Esc, Ctrl-C) quits,
//! `r` refreshes at once. A failed refresh keeps the last data on screen and shows the error.

use super::monitor_view::{draw, Screen, WeightsLine};
use crate::foundation::clock::unix_now;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct MonitorArgs {
    /// The manager's control URL (a trailing `/autoscaler`, as in the seed's monitor, is accepted).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval_secs: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum MonitorError {
    #[error("--interval-secs {0} must be a positive number of seconds")]
    Interval(f64),
    #[error("cannot build the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    #[error("terminal: {0}")]
    Terminal(#[from] std::io::Error),
}

/// The manager's base URL from what the user typed.
pub fn base_url(raw: &str) -> String {
    let trimmed = raw.trim().trim_end_matches('/');
    trimmed.strip_suffix("/autoscaler").unwrap_or(trimmed).to_string()
}

/// What a key press asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Quit,
    Refresh,
}

async fn get_json(http: &reqwest::Client, url: String) -> Result<serde_json::Value, String> {
    let resp = http.get(&url).send().await.map_err(|e| format!("{url}: {e}"))?;
    let resp = resp.error_for_status().map_err(|e| format!("{url}: {e}"))?;
    resp.json().await.map_err(|e| format!("{url}: {e}"))
}

/// One refresh: every answer, or the first error.
async fn fetch(http: &reqwest::Client, base: &str) -> Result<Screen, String> {
    let (engines, status, conditions, history, weights) = tokio::join!(
        get_json(http, format!("{base}/rollout/engines")),
        get_json(http, format!("{base}/autoscaler/status")),
        get_json(http, format!("{base}/autoscaler/conditions")),
        get_json(http, format!("{base}/autoscaler/scale_history?limit=6")),
        get_json(http, format!("{base}/rollout/weights")),
    );
    let mut screen = Screen::from_json(base, &engines?, &status?, &conditions?, &history?);
    screen.weights = WeightsLine::from_json(&weights?);
    screen.updated_at = Some(unix_now());
    Ok(screen)
}

/// Reads keys on a plain thread (crossterm's reads block) until `stop` is set.
fn spawn_key_reader(
    stop: Arc<AtomicBool>,
    tx: tokio::sync::mpsc::UnboundedSender<Command>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match event::poll(Duration::from_millis(100)) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(_) => return,
            }
            let Ok(Event::Key(key)) = event::read() else { continue };
            if key.kind != KeyEventKind::Press {
                continue;
            }
            let command = match key.code {
                KeyCode::Char('q') | KeyCode::Char('Q') | KeyCode::Esc => Some(Command::Quit),
                KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => Some(Command::Quit),
                KeyCode::Char('r') | KeyCode::Char('R') => Some(Command::Refresh),
                _ => None,
            };
            if let Some(c) = command {
                if tx.send(c).is_err() {
                    return;
                }
            }
        }
    })
}

pub async fn run(args: MonitorArgs) -> Result<(), MonitorError> {
    if !(args.interval_secs.is_finite() && args.interval_secs > 0.0) {
        return Err(MonitorError::Interval(args.interval_secs));
    }
    let base = base_url(&args.url);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(3)).build()?;
    let mut terminal = ratatui::try_init()?;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reader = spawn_key_reader(stop.clone(), tx);
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(args.interval_secs));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await; // the first tick is immediate
    let mut screen = Screen { url: base.clone(), ..Screen::default() };
    let result = loop {
        match fetch(&http, &base).await {
            Ok(fresh) => screen = fresh,
            Err(e) => screen.error = Some(e),
        }
        if let Err(e) = terminal.draw(|f| draw(f, &screen)) {
            break Err(MonitorError::Terminal(e));
        }
        let command = tokio::select! {
            _ = ticker.tick() => None,
            c = rx.recv() => Some(c.unwrap_or(Command::Quit)),
        };
        if command == Some(Command::Quit) {
            break Ok(());
        }
    };
    stop.store(true, Ordering::Relaxed);
    ratatui::restore();
    let _ = reader.join();
    result
}

#[cfg(test)]
mod tests {
    use super::base_url;

    #[test]
    fn accepts_the_seeds_url_form() {
        assert_eq!(base_url("http://localhost:8000/autoscaler"), "http://localhost:8000");
        assert_eq!(base_url("http://localhost:8000/"), "http://localhost:8000");
        assert_eq!(base_url(" http://h:1 "), "http://h:1");
    }
}
