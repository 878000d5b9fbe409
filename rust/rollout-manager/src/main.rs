// A lint is silenced only with #[expect(..., reason = "...")], which fails once it is no longer needed.
#![deny(clippy::allow_attributes, clippy::allow_attributes_without_reason)]
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use rollout_core::cli::{self, LayerError};
use rollout_core::{LogArgs, LogFormat, ServeArgs};
use rollout_manager::app::server::{shutdown_signal, Server};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

/// Elastic Rollout fleet manager: runs and scales a fleet of SGLang engines.
#[derive(Parser)]
#[command(name = "rollout-manager", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Exit when the process PID, which started this one, exits.
    ///
    /// Linux parent-death signal: `serve` gets SIGKILL (its engines stay with their agents or keepers, for a manager started
    /// again to re-adopt), every other command SIGTERM (an agent stops its engines). Refused
    /// when PID is not this process's parent (the parent is already gone). Never passed on to
    /// engines.
    #[arg(long, global = true, value_name = "PID", env = rollout_manager::foundation::host::PARENT_PID_ENV)]
    parent_pid: Option<i32>,
    #[command(flatten)]
    log: LogArgs,
}

/// The command line as `main` sees it: every flag of `serve`, `agent` and `monitor` also from
/// its environment variable (`ROLLOUT_MANAGER_<FLAG>`, `ROLLOUT_MANAGER_AGENT_<FLAG>`,
/// `ROLLOUT_MANAGER_MONITOR_<FLAG>`), `serve`'s also from its `--config` file
/// (see rollout_core::cli). Exits with clap's message (status 2, or 0 for --help) or the file's.
fn parse_command_line() -> Cli {
    let command = cli::with_env(Cli::command(), cli::ENV_PREFIX)
        .mut_subcommand("serve", |c| cli::with_env(c, cli::ENV_PREFIX))
        .mut_subcommand("agent", |c| cli::with_env(c, cli::AGENT_ENV_PREFIX))
        .mut_subcommand("monitor", |c| cli::with_env(c, cli::MONITOR_ENV_PREFIX));
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let parsed = cli::layered_matches(command, &argv, Some("serve"), |path| std::fs::read_to_string(path))
        .and_then(|layered| Ok(Cli::from_arg_matches(&layered.matches)?));
    match parsed {
        Ok(cli) => cli,
        Err(LayerError::Clap(e)) => e.exit(),
        Err(LayerError::File(e)) => {
            eprintln!("error: {e}");
            std::process::exit(2)
        }
    }
}

/// `--parent-pid`: die with the process that started this one.
fn die_with_parent(pid: i32, signal: nix::sys::signal::Signal) -> Result<(), String> {
    nix::sys::prctl::set_pdeathsig(signal)
        .map_err(|e| format!("--parent-pid: cannot set the parent-death signal: {e}"))?;
    let parent = nix::unistd::getppid().as_raw();
    if parent != pid {
        return Err(format!(
            "invalid --parent-pid {pid}: this process's parent is {parent}, so the process that started it is gone"
        ));
    }
    Ok(())
}

#[derive(Subcommand)]
enum Command {
    /// Run the manager: control API, router, and the engines on this machine.
    ///
    /// A flag given twice takes its last value (as launch scripts that append overrides expect).
    #[command(
        args_override_self = true,
        after_help = "Every flag can also be set by its environment variable ([env: ...]) or in the --config \
                      file: the command line wins, then the environment, then the file, then the default. \
                      The API token comes from --api-token-file or ROLLOUT_MANAGER_API_TOKEN, never from \
                      the command line. `-h` gives a summary, `--help` the details."
    )]
    Serve(Box<ServeArgs>),
    /// Node agent: host engine processes on this node for a manager elsewhere (Ray mode), over
    /// gRPC. See docs/ray.md.
    Agent(rollout_manager::app::agent::AgentArgs),
    /// Internal: keep one engine alive across a manager restart (see `--reattach-grace-secs`).
    #[command(hide = true)]
    Keeper(rollout_manager::adapters::keeper::KeeperArgs),
    /// Live terminal view of the engines and the autoscaler (`q` quits, `r` refreshes).
    Monitor(rollout_manager::interfaces::autoscaler::monitor::MonitorArgs),
    /// Replay a recorded metrics trace through the autoscaler's decide() with a YAML config.
    AutoscalerReplay(rollout_manager::interfaces::autoscaler::replay::ReplayArgs),
    /// Print the control API's OpenAPI document (what `GET /openapi.json` serves).
    Openapi,
}

fn main() -> ExitCode {
    let cli = parse_command_line();
    if let Some(pid) = cli.parent_pid {
        // Before any thread starts; the signal is the process's own from now on.
        let signal = match cli.command {
            Command::Serve(_) => nix::sys::signal::Signal::SIGKILL,
            _ => nix::sys::signal::Signal::SIGTERM,
        };
        if let Err(e) = die_with_parent(pid, signal) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    init_logging(cli.log.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config = match cli.command {
        Command::Serve(args) => args.config,
        Command::Monitor(args) => {
            return exit("monitor", runtime.block_on(rollout_manager::interfaces::autoscaler::monitor::run(args)))
        }
        Command::AutoscalerReplay(args) => {
            let summary = rollout_manager::interfaces::autoscaler::replay::run(&args, &mut std::io::stdout().lock());
            if let Ok(s) = &summary {
                eprintln!("{} decisions: {} scale-outs, {} scale-ins", s.evaluations, s.scale_outs, s.scale_ins);
            }
            return exit("autoscaler-replay", summary);
        }
        Command::Openapi => {
            print!("{}", rollout_manager::interfaces::openapi::document());
            return ExitCode::SUCCESS;
        }
        Command::Agent(args) => return exit("agent", runtime.block_on(rollout_manager::app::agent::run(args))),
        Command::Keeper(args) => {
            return match runtime.block_on(rollout_manager::adapters::keeper::run_keeper(args)) {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: keeper: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    runtime.block_on(async move {
        let server = match Server::build(config).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        };
        if let (Ok(control), Ok(router)) = (server.control_addr(), server.router_addr()) {
            // One line on stdout, for scripts and tests that start the manager on port 0.
            let mut out = std::io::stdout();
            let _ = writeln!(out, "rollout-manager listening control=http://{control} router=http://{router}");
            if let Some(Ok(trainer)) = server.trainer_addr() {
                let _ = writeln!(out, "rollout-manager trainer-port http://{trainer}");
            }
            let _ = out.flush();
        }
        match server.run(shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// The log on stderr, filtered by RUST_LOG (default `info`): text lines, or with `--log-format
/// json` one JSON object per line (`timestamp`, `level`, `target`, the event's fields with
/// `message`, and the spans it happened in).
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().flatten_event(true).with_ansi(false).init(),
    }
}

/// Exit code of a subcommand: 0, or 1 with the error on stderr.
fn exit<T, E: std::fmt::Display>(what: &str, result: Result<T, E>) -> ExitCode {
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {what}: {e}");
            ExitCode::FAILURE
        }
    }
}
