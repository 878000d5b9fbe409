//! What `rollout-manager monitor` shows: a [`Screen`] built from the manager's JSON answers
//! (pure, tested without a terminal) and drawn with ratatui ([`draw`], tested on its
//! `TestBackend`).

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use ratatui::Frame;
use serde_json::Value;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineRow {
    pub id: String,
    pub status: String,
    pub version: String,
    pub origin: String,
    pub in_flight: u64,
    /// From the autoscaler's latest read of the engine.
    pub token_usage: Option<f64>,
    pub queue: Option<f64>,
    pub running: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConditionRow {
    pub name: String,
    pub kind: String,
    pub triggered: bool,
    pub holding: bool,
    pub value: Option<f64>,
    pub threshold: f64,
    pub held_secs: f64,
    pub duration_secs: f64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecisionRow {
    pub at: f64,
    pub action: String,
    pub from: u64,
    pub to: u64,
    pub status: String,
    pub reason: String,
}

/// One refresh's worth of data.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Screen {
    pub url: String,
    pub updated_at: Option<f64>,
    /// Why the last refresh failed, if it did (the rest is the last good data).
    pub error: Option<String>,
    pub engines: Vec<EngineRow>,
    pub enabled: Option<bool>,
    pub running: bool,
    pub signal: String,
    pub current_engines: u64,
    pub min_engines: u64,
    pub max_engines: u64,
    /// "action: reason" of the latest decision.
    pub decision: String,
    pub conditions: Vec<ConditionRow>,
    pub history: Vec<DecisionRow>,
    /// The fleet's weight version and the update in flight (`GET /rollout/weights`).
    pub weights: WeightsLine,
}

/// The fleet's weight version, and a running update's progress.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WeightsLine {
    pub version: String,
    /// The update in flight: target version, status, engines done / in it, failed.
    pub update: Option<UpdateProgress>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateProgress {
    pub update_id: String,
    pub version: String,
    pub status: String,
    pub engines_done: u64,
    pub engines_total: u64,
    pub engines_failed: u64,
    /// Checkpoint bytes checksummed so far and in all, while the update is checksumming.
    pub hashed: Option<(u64, u64)>,
}

impl WeightsLine {
    pub fn from_json(weights: &Value) -> Self {
        let update = weights.get("update").filter(|u| u.is_object()).map(|u| {
            let engines: Vec<&Value> =
                u.get("engines").and_then(Value::as_object).map(|m| m.values().collect()).unwrap_or_default();
            let count = |wanted: &[&str]| engines.iter().filter(|e| wanted.contains(&s(e, "status").as_str())).count();
            let hashed =
                match (u.get("hashed_bytes").and_then(Value::as_u64), u.get("total_bytes").and_then(Value::as_u64)) {
                    (Some(done), Some(total)) => Some((done, total)),
                    _ => None,
                };
            UpdateProgress {
                update_id: s(u, "update_id"),
                version: s(u, "version"),
                status: s(u, "status"),
                engines_done: count(&["VERIFIED", "SKIPPED"]) as u64,
                engines_total: engines.len() as u64,
                engines_failed: count(&["FAILED"]) as u64,
                hashed,
            }
        });
        Self { version: s(weights, "version"), update }
    }

    /// One line: the fleet's version, then the update in flight if any.
    pub fn text(&self) -> String {
        let version = if self.version.is_empty() { "-" } else { &self.version };
        match &self.update {
            None => format!("weights: {version} (no update running)"),
            Some(u) => {
                let mut line = format!(
                    "weights: {version} -> {} {} ({}): {}/{} engines done",
                    u.version, u.status, u.update_id, u.engines_done, u.engines_total
                );
                if u.engines_failed > 0 {
                    line.push_str(&format!(", {} failed", u.engines_failed));
                }
                if let Some((done, total)) = u.hashed {
                    let pct = if total == 0 { 100.0 } else { done as f64 * 100.0 / total as f64 };
                    line.push_str(&format!(", checksum {pct:.0}% of {:.1} GiB", total as f64 / (1u64 << 30) as f64));
                }
                line
            }
        }
    }
}

fn f(v: &Value, k: &str) -> Option<f64> {
    v.get(k).and_then(Value::as_f64)
}

fn s(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_str).unwrap_or("").to_string()
}

fn u(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

impl Screen {
    /// Builds the screen from `GET /rollout/engines`, `/autoscaler/status`,
    /// `/autoscaler/conditions` and `/autoscaler/scale_history`.
    pub fn from_json(url: &str, engines: &Value, status: &Value, conditions: &Value, history: &Value) -> Self {
        let loads = conditions.get("engines").cloned().unwrap_or(Value::Null);
        let mut rows = Vec::new();
        if let Some(models) = engines.get("models").and_then(Value::as_object) {
            for model in models.values() {
                for e in model.get("engines").and_then(Value::as_array).into_iter().flatten() {
                    let id = s(e, "engine_id");
                    let load = loads.get(&id).cloned().unwrap_or(Value::Null);
                    rows.push(EngineRow {
                        status: s(e, "status"),
                        version: s(e, "weight_version"),
                        origin: s(e, "origin"),
                        in_flight: u(e, "in_flight"),
                        token_usage: f(&load, "token_usage"),
                        queue: f(&load, "num_queue_reqs"),
                        running: f(&load, "num_running_reqs"),
                        id,
                    });
                }
            }
        }
        let mut conds: Vec<ConditionRow> = conditions
            .get("conditions")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(name, c)| ConditionRow {
                        name: name.clone(),
                        kind: s(c, "type"),
                        triggered: c.get("triggered").and_then(Value::as_bool).unwrap_or(false),
                        holding: c.get("holding").and_then(Value::as_bool).unwrap_or(false),
                        value: f(c, "value"),
                        threshold: f(c, "threshold").unwrap_or(0.0),
                        held_secs: f(c, "held_secs").unwrap_or(0.0),
                        duration_secs: f(c, "duration_secs").unwrap_or(0.0),
                    })
                    .collect()
            })
            .unwrap_or_default();
        // Scale-out conditions first, then scale-in.
        conds.sort_by(|a, b| b.kind.cmp(&a.kind).then(a.name.cmp(&b.name)));
        let decision = status
            .get("last_decision")
            .filter(|d| !d.is_null())
            .or_else(|| conditions.get("decision"))
            .map(|d| format!("{}: {}", s(d, "action"), s(d, "reason")))
            .unwrap_or_else(|| "none yet".into());
        let history = history
            .get("history")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|h| DecisionRow {
                at: f(h, "triggered_at").unwrap_or(0.0),
                action: s(h, "action"),
                from: u(h, "from_engines"),
                to: u(h, "to_engines"),
                status: s(h, "status"),
                reason: s(h, "reason"),
            })
            .collect();
        Screen {
            url: url.to_string(),
            updated_at: None,
            error: None,
            engines: rows,
            enabled: status.get("enabled").and_then(Value::as_bool),
            running: status.get("running").and_then(Value::as_bool).unwrap_or(false),
            signal: s(status, "signal"),
            current_engines: u(status, "current_engines"),
            min_engines: u(status, "effective_min_engines"),
            max_engines: u(status, "effective_max_engines"),
            decision,
            conditions: conds,
            history,
            weights: WeightsLine::default(),
        }
    }
}

/// `HH:MM:SS` (UTC) of a Unix time.
pub fn clock(unix: f64) -> String {
    let secs = unix.max(0.0) as u64 % 86_400;
    format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

fn status_color(status: &str) -> Color {
    match status {
        "ACTIVE" | "COMPLETED" => Color::Green,
        "FAILED" | "UNHEALTHY" | "REJECTED" | "CANCELLED" => Color::Red,
        "DRAINING" | "REMOVING" => Color::Yellow,
        _ => Color::Cyan,
    }
}

/// Draws the whole screen.
pub fn draw(frame: &mut Frame, screen: &Screen) {
    let [header, middle, bottom, footer] =
        Layout::vertical([Constraint::Length(6), Constraint::Min(8), Constraint::Length(8), Constraint::Length(1)])
            .areas(frame.area());
    let [left, right] = Layout::horizontal([Constraint::Percentage(58), Constraint::Percentage(42)]).areas(middle);
    draw_header(frame, screen, header);
    draw_engines(frame, screen, left);
    draw_conditions(frame, screen, right);
    draw_history(frame, screen, bottom);
    frame.render_widget(Paragraph::new("q quit   r refresh now"), footer);
}

/// The autoscaler's state, its last decision and the fleet's weights.
fn draw_header(frame: &mut Frame, screen: &Screen, area: Rect) {
    let state = match screen.enabled {
        Some(true) => Span::styled("ENABLED", Style::default().fg(Color::Green).add_modifier(Modifier::BOLD)),
        Some(false) => Span::styled("DISABLED", Style::default().fg(Color::Yellow).add_modifier(Modifier::BOLD)),
        None => Span::raw("unknown"),
    };
    let updated = screen.updated_at.map_or_else(|| "never".into(), clock);
    let mut lines = vec![
        Line::from(vec![
            Span::raw("autoscaler "),
            state,
            Span::raw(format!(
                "  {}  signal: {}  engines: {} (min {}, max {})  updated {updated} UTC",
                if screen.running { "running" } else { "not running" },
                if screen.signal.is_empty() { "-" } else { &screen.signal },
                screen.current_engines,
                screen.min_engines,
                screen.max_engines,
            )),
        ]),
        Line::from(format!("decision: {}", screen.decision)),
        Line::from(screen.weights.text()),
    ];
    if let Some(e) = &screen.error {
        lines.push(Line::from(Span::styled(format!("error: {e}"), Style::default().fg(Color::Red))));
    }
    let title = format!(" Elastic Rollout monitor: {} ", screen.url);
    frame.render_widget(Paragraph::new(lines).block(Block::bordered().title(title)), area);
}

fn bold() -> Style {
    Style::default().add_modifier(Modifier::BOLD)
}

/// One row per engine.
fn draw_engines(frame: &mut Frame, screen: &Screen, area: Rect) {
    let engine_rows = screen.engines.iter().map(|e| {
        Row::new(vec![
            Cell::from(e.id.clone()),
            Cell::from(e.status.clone()).style(Style::default().fg(status_color(&e.status))),
            Cell::from(e.version.clone()),
            Cell::from(e.origin.clone()),
            Cell::from(e.in_flight.to_string()),
            Cell::from(e.token_usage.map_or_else(|| "-".into(), |u| format!("{:.0}%", u * 100.0))),
            Cell::from(opt(e.queue, 0)),
            Cell::from(opt(e.running, 0)),
        ])
    });
    let engines = Table::new(
        engine_rows,
        [
            Constraint::Length(9),
            Constraint::Length(15),
            Constraint::Length(10),
            Constraint::Length(8),
            Constraint::Length(5),
            Constraint::Length(4),
            Constraint::Length(5),
            Constraint::Length(4),
        ],
    )
    .header(Row::new(vec!["engine", "status", "version", "origin", "in_fl", "kv", "queue", "run"]).style(bold()))
    .block(Block::bordered().title(format!(" Engines ({}) ", screen.engines.len())));
    frame.render_widget(engines, area);
}

/// Each scaling condition: whether it is met, its value against its threshold, how long held.
fn draw_conditions(frame: &mut Frame, screen: &Screen, area: Rect) {
    let cond_rows = screen.conditions.iter().map(|c| {
        let (mark, color) = match (c.triggered, c.holding) {
            (true, _) => ("YES", Color::Green),
            (false, true) => ("...", Color::Yellow),
            (false, false) => ("no", Color::DarkGray),
        };
        Row::new(vec![
            Cell::from(c.name.clone()),
            Cell::from(if c.kind == "scale_out" { "out" } else { "in" }),
            Cell::from(mark).style(Style::default().fg(color)),
            Cell::from(opt(c.value, 2)),
            Cell::from(format!("{:.2}", c.threshold)),
            Cell::from(format!("{:.0}/{:.0}s", c.held_secs, c.duration_secs)),
        ])
    });
    let conditions = Table::new(
        cond_rows,
        [
            Constraint::Length(18),
            Constraint::Length(3),
            Constraint::Length(3),
            Constraint::Length(7),
            Constraint::Length(6),
            Constraint::Length(9),
        ],
    )
    .header(Row::new(vec!["condition", "for", "met", "value", "thresh", "held"]).style(bold()))
    .block(Block::bordered().title(" Conditions "));
    frame.render_widget(conditions, area);
}

/// The autoscaler's recent decisions.
fn draw_history(frame: &mut Frame, screen: &Screen, area: Rect) {
    let history_rows = screen.history.iter().map(|h| {
        Row::new(vec![
            Cell::from(clock(h.at)),
            Cell::from(h.action.clone()),
            Cell::from(format!("{} -> {}", h.from, h.to)),
            Cell::from(h.status.clone()).style(Style::default().fg(status_color(&h.status))),
            Cell::from(h.reason.clone()),
        ])
    });
    let history = Table::new(
        history_rows,
        [
            Constraint::Length(8),
            Constraint::Length(9),
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Min(20),
        ],
    )
    .header(Row::new(vec!["time", "action", "engines", "status", "reason"]).style(bold()))
    .block(Block::bordered().title(" Recent decisions "));
    frame.render_widget(history, area);
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;
    use serde_json::json;

    fn screen() -> Screen {
        let engines = json!({"models": {"default": {"engines": [
            {"engine_id": "engine_0", "status": "ACTIVE", "weight_version": "v1", "origin": "initial", "in_flight": 3},
            {"engine_id": "engine_2", "status": "HEALTH_CHECKING", "weight_version": null, "origin": "dynamic", "in_flight": 0}]}}});
        let status = json!({"enabled": true, "running": true, "signal": "serving", "current_engines": 2,
            "effective_min_engines": 2, "effective_max_engines": 4,
            "last_decision": {"action": "scale_out", "reason": "Conditions met: queue_backlog"}});
        let conditions = json!({"conditions": {
            "queue_backlog": {"type": "scale_out", "triggered": true, "holding": true, "value": 12.0, "threshold": 10.0, "held_secs": 3.0, "duration_secs": 2.0},
            "no_queue": {"type": "scale_in", "triggered": false, "holding": false, "value": 24.0, "threshold": 0.0, "held_secs": 0.0, "duration_secs": 5.0}},
            "engines": {"engine_0": {"token_usage": 0.5, "num_queue_reqs": 12.0, "num_running_reqs": 4.0}}});
        let history = json!({"history": [{"triggered_at": 3661.0, "action": "scale_out", "from_engines": 2, "to_engines": 3,
            "status": "PENDING", "reason": "Conditions met: queue_backlog"}]});
        Screen::from_json("http://127.0.0.1:8000", &engines, &status, &conditions, &history)
    }

    #[test]
    fn builds_rows_from_the_api_answers() {
        let s = screen();
        assert_eq!(s.engines.len(), 2);
        assert_eq!(s.engines[0].token_usage, Some(0.5));
        assert_eq!(s.engines[1].token_usage, None);
        assert_eq!(s.conditions[0].name, "queue_backlog", "scale-out conditions first");
        assert_eq!(s.decision, "scale_out: Conditions met: queue_backlog");
        assert_eq!(s.history[0].to, 3);
        assert_eq!(clock(3661.0), "01:01:01");
    }

    #[test]
    fn renders_engines_conditions_and_decisions() {
        let mut terminal = Terminal::new(TestBackend::new(120, 30)).unwrap();
        let mut s = screen();
        s.error = Some("connection refused".into());
        s.weights = WeightsLine::from_json(&json!({"version": "step-3", "update": {"update_id": "wu-4",
            "version": "step-4", "status": "UPDATING",
            "engines": {"engine_0": {"status": "VERIFIED"}, "engine_2": {"status": "UPDATING"}}}}));
        terminal.draw(|f| draw(f, &s)).unwrap();
        let text: String = terminal
            .backend()
            .buffer()
            .content()
            .chunks(120)
            .map(|row| row.iter().map(|c| c.symbol()).collect::<String>() + "\n")
            .collect();
        for needle in [
            "ENABLED",
            "engine_0",
            "ACTIVE",
            "HEALTH_CHECKING",
            "50%",
            "queue_backlog",
            "YES",
            "01:01:01",
            "2 -> 3",
            "error: connection refused",
            "weights: step-3 -> step-4 UPDATING (wu-4): 1/2 engines done",
            "q quit",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
    }

    #[test]
    fn weights_line_shows_the_version_and_a_running_update() {
        let idle = WeightsLine::from_json(&json!({"version": "v1", "update": null}));
        assert_eq!(idle.text(), "weights: v1 (no update running)");
        let hashing = WeightsLine::from_json(&json!({"version": "v1", "update": {"update_id": "wu-2",
            "version": "v2", "status": "CHECKSUMMING", "engines": {},
            "hashed_bytes": 1u64 << 30, "total_bytes": 4u64 << 30}}));
        assert_eq!(hashing.text(), "weights: v1 -> v2 CHECKSUMMING (wu-2): 0/0 engines done, checksum 25% of 4.0 GiB");
        let failing = WeightsLine::from_json(&json!({"version": "v1", "update": {"update_id": "wu-3",
            "version": "v3", "status": "UPDATING",
            "engines": {"a": {"status": "FAILED"}, "b": {"status": "VERIFIED"}, "c": {"status": "PENDING"}}}}));
        assert_eq!(failing.text(), "weights: v1 -> v3 UPDATING (wu-3): 1/3 engines done, 1 failed");
    }
}
