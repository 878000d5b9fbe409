//! `rollout-relay`: the weight relay's command line.
//!
//! - `rollout-relay recv --listen 127.0.0.1:7070 --dest /dev/shm/elastic-rollout` serves until
//!   SIGTERM/SIGINT;
//! - `rollout-relay send --version v3 --source DIR --to ADDR[,ADDR...]` sends one version down
//!   the chain and prints the JSON report; exit code 0 when every receiver holds the verified
//!   version, 1 when any failed, 2 on bad usage.

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use rollout_relay::{Receiver, ReceiverOptions, SendOptions, Transport};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser, Debug)]
#[command(name = "rollout-relay", version, about = "Broadcast checkpoint versions to node-local storage.")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Receive versions under --dest and forward them along the chain.
    Recv {
        /// Address to listen on (loopback by default).
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: String,
        /// Root directory; each version lands in DEST/<version>/.
        #[arg(long)]
        dest: PathBuf,
        /// File holding the token senders must present.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// Seconds to wait for any one frame.
        #[arg(long, default_value_t = 120)]
        io_timeout_secs: u64,
        /// CUDA device for NCCL transfers (builds with --features nccl).
        #[arg(long, default_value_t = 0)]
        nccl_device: usize,
    },
    /// Send one version to every receiver of the chain.
    Send {
        /// Version name (the directory name on the receivers).
        #[arg(long)]
        version: String,
        /// Directory holding the version's files.
        #[arg(long)]
        source: PathBuf,
        /// Receivers, in chain order, comma separated (host:port).
        #[arg(long, value_delimiter = ',', required = true)]
        to: Vec<SocketAddr>,
        /// Chunk size in MiB (1..=64).
        #[arg(long, default_value_t = 4)]
        chunk_mib: usize,
        /// Attempts per receiver, the first included.
        #[arg(long, default_value_t = 3)]
        attempts: u32,
        /// File holding the receivers' token.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// tcp (the chain) or nccl (needs a build with --features nccl and a GPU on every node).
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "nccl"])]
        transport: String,
    },
}

fn read_token(path: Option<PathBuf>, flag: &str) -> anyhow::Result<Option<String>> {
    path.map(|p| {
        std::fs::read_to_string(&p)
            .map(|t| t.trim().to_string())
            .with_context(|| format!("{flag}: cannot read {}", p.display()))
    })
    .transpose()
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Recv { listen, dest, token_file, io_timeout_secs, nccl_device } => {
            let token = read_token(token_file, "--token-file")?;
            let receiver = Receiver::bind(&listen, &dest)
                .await
                .with_context(|| format!("--listen {listen} / --dest {}", dest.display()))?
                .with_options(ReceiverOptions {
                    token,
                    io_timeout: Duration::from_secs(io_timeout_secs),
                    nccl_device,
                    ..ReceiverOptions::default()
                });
            let addr = receiver.local_addr()?;
            // Handlers first: a parent may signal as soon as it read the line below.
            let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
            let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
            let handle = receiver.spawn()?;
            // One line on stdout so a parent started with --listen 127.0.0.1:0 learns the port.
            println!("listening on {addr}");
            tracing::info!(%addr, dest = %dest.display(), "relay receiver ready");
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            handle.shutdown().await;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Send { version, source, to, chunk_mib, attempts, token_file, transport } => {
            if !(1..=64).contains(&chunk_mib) {
                anyhow::bail!("--chunk-mib must be between 1 and 64, got {chunk_mib}");
            }
            let opts = SendOptions {
                chunk_size: chunk_mib << 20,
                max_attempts: attempts,
                token: read_token(token_file, "--token-file")?,
                transport: if transport == "nccl" { Transport::Nccl } else { Transport::Tcp },
                ..SendOptions::default()
            };
            let report = rollout_relay::send(&version, &source, &to, &opts)
                .await
                .with_context(|| format!("--version {version} --source {}", source.display()))?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(if report.all_ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
    }
}
