//! Tests of the layering: flag > environment > file > default, the file's checks, and the
//! environment variables shown in `--help`.
//!
//! Each test that sets environment variables uses a prefix of its own (`RM_TEST_<name>_`), so
//! tests running in parallel never see each other's variables and the real `ROLLOUT_MANAGER_*`
//! of the shell running them is never read.

use super::*;
use crate::config::PlacementMode;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// The binary's shape: `--log-format` global, `--config` in the `serve` subcommand.
#[derive(Parser, Debug)]
#[command(name = "rollout-manager")]
struct Program {
    #[command(flatten)]
    log: LogArgs,
    #[command(subcommand)]
    command: Sub,
}

#[derive(Subcommand, Debug)]
enum Sub {
    #[command(args_override_self = true)]
    Serve(Box<ServeArgs>),
}

/// The Python module's shape: `serve`'s arguments at the top.
#[derive(Parser, Debug)]
#[command(name = "rollout-manager serve", args_override_self = true)]
struct Flat {
    #[command(flatten)]
    log: LogArgs,
    #[command(flatten)]
    args: ServeArgs,
}

fn program(prefix: &str) -> Command {
    with_env(Program::command(), prefix).mut_subcommand("serve", |s| with_env(s, prefix))
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

/// Parses `args` (after `rollout-manager serve`) with a file named `file_name` holding `text`.
fn serve(
    prefix: &str,
    args: &[&str],
    file_name: &str,
    text: &str,
) -> Result<(ServeArgs, LogFormat, Layered), LayerError> {
    let mut argv = vec!["rollout-manager", "serve"];
    argv.extend_from_slice(args);
    let expected = PathBuf::from(file_name);
    let layered = layered_matches(program(prefix), &os(&argv), Some("serve"), |path| {
        assert_eq!(path, expected, "the file read is the one named by --config");
        Ok(text.to_string())
    })?;
    let program = Program::from_arg_matches(&layered.matches)?;
    let Sub::Serve(args) = program.command;
    Ok((*args, program.log.log_format, layered))
}

fn flat(prefix: &str, args: &[&str], text: &str) -> Result<(ServeArgs, LogFormat, Layered), LayerError> {
    let mut argv = vec!["rollout-manager serve"];
    argv.extend_from_slice(args);
    let layered = layered_matches(with_env(Flat::command(), prefix), &os(&argv), None, |_| Ok(text.to_string()))?;
    let parsed = Flat::from_arg_matches(&layered.matches)?;
    Ok((parsed.args, parsed.log.log_format, layered))
}

fn file_error(result: Result<(ServeArgs, LogFormat, Layered), LayerError>) -> String {
    match result {
        Err(LayerError::File(e)) => e.to_string(),
        Err(LayerError::Clap(e)) => panic!("expected a file error, got clap's: {e}"),
        Ok((args, ..)) => panic!("expected a file error, got {args:?}"),
    }
}

/// The port given as a flag, in the environment, in the file; the port expected and its source.
type PrecedenceCase = (Option<&'static str>, Option<&'static str>, Option<&'static str>, u16, Source);

#[test]
fn flag_beats_env_beats_file_beats_default() {
    let cases: [PrecedenceCase; 7] = [
        (Some("1001"), Some("1002"), Some("1003"), 1001, Source::CommandLine),
        (Some("1001"), None, Some("1003"), 1001, Source::CommandLine),
        (Some("1001"), Some("1002"), None, 1001, Source::CommandLine),
        (None, Some("1002"), Some("1003"), 1002, Source::Env),
        (None, Some("1002"), None, 1002, Source::Env),
        (None, None, Some("1003"), 1003, Source::ConfigFile),
        (None, None, None, 8000, Source::Default),
    ];
    for (i, (flag, env, file, expected, source)) in cases.into_iter().enumerate() {
        for (shape, ext) in [("yaml", "yaml"), ("toml", "toml")] {
            let prefix = format!("RM_TEST_PRECEDENCE_{i}_{shape}_");
            let var = format!("{prefix}PORT");
            match env {
                Some(v) => std::env::set_var(&var, v),
                None => std::env::remove_var(&var),
            }
            let path = format!("fleet.{ext}");
            let text = match (file, shape) {
                (Some(v), "yaml") => format!("port: {v}\nmodel-name: from-file\n"),
                (Some(v), _) => format!("port = {v}\nmodel-name = \"from-file\"\n"),
                (None, "yaml") => "model-name: from-file\n".to_string(),
                (None, _) => "model-name = \"from-file\"\n".to_string(),
            };
            let mut args = vec!["--config", path.as_str()];
            if let Some(v) = flag {
                args.extend(["--port", v]);
            }
            let (parsed, _, layered) = serve(&prefix, &args, &path, &text).unwrap();
            let case = format!("case {i} ({shape}): flag {flag:?}, env {env:?}, file {file:?}");
            assert_eq!(parsed.config.port, expected, "{case}");
            assert_eq!(parsed.config.model_name, "from-file", "{case}");
            let sources = layered.sources(Some("serve"));
            assert_eq!(sources["port"], source, "{case}");
            assert_eq!(sources["model_name"], Source::ConfigFile, "{case}");
            assert_eq!(sources["gpus"], Source::Default, "{case}");
            assert_eq!(sources["config_file"], Source::CommandLine, "{case}");
            std::env::remove_var(&var);
        }
    }
}

#[test]
fn the_config_file_may_come_from_the_environment() {
    let prefix = "RM_TEST_CONFIG_ENV_";
    std::env::set_var(format!("{prefix}CONFIG"), "from-env.toml");
    let (parsed, _, layered) = serve(prefix, &[], "from-env.toml", "max-engines = 9").unwrap();
    assert_eq!(parsed.config.max_engines, 9);
    assert_eq!(parsed.config_file, Some(PathBuf::from("from-env.toml")));
    assert_eq!(layered.sources(Some("serve"))["config_file"], Source::Env);
    std::env::remove_var(format!("{prefix}CONFIG"));
}

#[test]
fn without_a_file_nothing_is_read() {
    let layered = layered_matches(program("RM_TEST_NO_FILE_"), &os(&["rm", "serve"]), Some("serve"), |p| {
        panic!("read {p:?} though no --config was given")
    })
    .unwrap();
    assert!(layered.file.is_none());
    assert!(layered.sources(Some("serve")).values().all(|s| *s == Source::Default));
}

#[test]
fn every_flag_has_its_environment_variable() {
    let cmd = program(ENV_PREFIX);
    let serve = cmd.find_subcommand("serve").unwrap();
    let env = |id: &str| {
        let arg = serve.get_arguments().find(|a| a.get_id() == id).unwrap();
        arg.get_env().map(|e| e.to_string_lossy().into_owned())
    };
    assert_eq!(env("scale_out_timeout").as_deref(), Some("ROLLOUT_MANAGER_SCALE_OUT_TIMEOUT_SECS"));
    assert_eq!(env("engine_args").as_deref(), Some("ROLLOUT_MANAGER_ENGINE_ARG"));
    assert_eq!(env("config_file").as_deref(), Some("ROLLOUT_MANAGER_CONFIG"));
    assert!(serve.get_arguments().all(|a| a.get_long().is_none() || a.get_env().is_some()));
    let log = cmd.get_arguments().find(|a| a.get_id() == "log_format").unwrap();
    assert_eq!(log.get_env().unwrap(), "ROLLOUT_MANAGER_LOG_FORMAT");
}

#[test]
fn help_shows_headings_and_variables_but_hides_secret_values() {
    let prefix = "RM_TEST_HELP_";
    std::env::set_var(format!("{prefix}ENGINE_ARG"), "--api-key=s3cret-env");
    std::env::set_var(format!("{prefix}MODEL_NAME"), "shown-model");
    let mut cmd = with_env(Flat::command(), prefix);
    let help = cmd.render_long_help().to_string();
    for heading in [heading::NETWORK, heading::ENGINES, heading::SCALING, heading::STATE] {
        assert!(help.contains(&format!("{heading}:")), "no heading {heading:?} in:\n{help}");
    }
    assert!(help.contains(&format!("[env: {prefix}ENGINE_ARG]")), "{help}");
    assert!(help.contains(&format!("[env: {prefix}MODEL_NAME=shown-model]")), "{help}");
    assert!(help.contains(&format!("[env: {prefix}PORT]")), "an unset variable shows no value: {help}");
    assert!(help.contains("[alias: --scale-out-timeout]"), "{help}");
    assert!(!help.contains("s3cret"), "{help}");
    // A value the file gives a secret-prone flag is not shown as its default either.
    let mut argv = os(&["rm", "--config", "f.yaml"]);
    let layered = layered_matches(with_env(Flat::command(), prefix), &argv, None, |_| {
        Ok("router: smg=http://u:s3cret@h\n".into())
    })
    .unwrap();
    let help = layered.command.clone().render_long_help().to_string();
    assert!(!help.contains("s3cret"), "{help}");
    argv.push("--help".into());
    assert!(matches!(
        layered_matches(with_env(Flat::command(), prefix), &argv, None, |_| Ok(String::new())),
        Err(LayerError::Clap(e)) if e.kind() == clap::error::ErrorKind::DisplayHelp
    ));
    std::env::remove_var(format!("{prefix}ENGINE_ARG"));
    std::env::remove_var(format!("{prefix}MODEL_NAME"));
}

#[test]
fn old_duration_spellings_still_work() {
    let prefix = "RM_TEST_ALIASES_";
    let (parsed, ..) = serve(
        prefix,
        &[
            "--scale-out-timeout",
            "11",
            "--scale-in-drain-timeout=12",
            "--scale-in-shutdown-timeout",
            "13",
            "--engine-startup-timeout",
            "14",
        ],
        "",
        "",
    )
    .unwrap();
    let c = &parsed.config;
    assert_eq!((c.scale_out_timeout, c.scale_in_drain_timeout), (11.0, 12.0));
    assert_eq!((c.scale_in_shutdown_timeout, c.engine_startup_timeout), (13.0, 14.0));
    let (parsed, ..) =
        serve(prefix, &["--scale-out-timeout-secs=21", "--engine-startup-timeout-secs", "0.5"], "", "").unwrap();
    assert_eq!((parsed.config.scale_out_timeout, parsed.config.engine_startup_timeout), (21.0, 0.5));
    // In the file, the old spelling is a key too.
    let (parsed, ..) = serve(prefix, &["--config", "a.yml"], "a.yml", "scale-in-drain-timeout: 31\n").unwrap();
    assert_eq!(parsed.config.scale_in_drain_timeout, 31.0);
    let err =
        file_error(serve(prefix, &["--config", "a.yml"], "a.yml", "scale-out-timeout: 1\nscale-out-timeout-secs: 2\n"));
    assert!(err.contains("--scale-out-timeout-secs") && err.contains("`scale-out-timeout`"), "{err}");
}

#[test]
fn file_errors_name_the_file_the_key_and_the_flag() {
    let prefix = "RM_TEST_FILE_ERRORS_";
    // (file name, text, what the message must contain)
    let cases: [(&str, &str, &[&str]); 11] = [
        ("f.json", "{}", &["--config f.json", ".yaml, .yml or .toml"]),
        ("f", "", &["--config f", ".toml"]),
        ("f.yaml", "bogus-flag: 1\n", &["f.yaml", "unknown key `bogus-flag`"]),
        ("f.yaml", "max_engines: 3\n", &["unknown key `max_engines`", "with dashes: `max-engines`"]),
        ("f.toml", "config = \"other.toml\"\n", &["unknown key `config`", "cannot name another"]),
        ("f.yaml", "port: abc\n", &["f.yaml", "key `port`", "'abc'", "--port"]),
        ("f.toml", "engine = \"vllm\"\n", &["key `engine`", "'vllm'", "--engine"]),
        ("f.yaml", "port: [1, 2]\n", &["key `port`", "--port takes one value"]),
        ("f.yaml", "fully-async: 3\n", &["key `fully-async`", "true or false"]),
        ("f.toml", "[engines]\ngpus = 2\n", &["key `engines`", "not a table"]),
        ("f.yaml", "- port\n", &["f.yaml", "mapping"]),
    ];
    for (name, text, expected) in cases {
        let err = file_error(serve(prefix, &["--config", name], name, text));
        for part in expected {
            assert!(err.contains(part), "{name} {text:?}: {err:?} lacks {part:?}");
        }
    }
    let read = layered_matches(program(prefix), &os(&["rm", "serve", "--config", "gone.yaml"]), Some("serve"), |_| {
        Err(std::io::Error::from(std::io::ErrorKind::NotFound))
    });
    let err = match read {
        Err(LayerError::File(e)) => e.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(err.starts_with("cannot read --config gone.yaml"), "{err}");
}

#[test]
fn values_from_the_file_are_validated_like_flags() {
    let prefix = "RM_TEST_VALIDATE_";
    let (parsed, ..) = serve(prefix, &["--config", "v.yaml"], "v.yaml", "scale-out-timeout-secs: 0\n").unwrap();
    let err = parsed.config.validate().unwrap_err();
    assert_eq!(err.flag, "--scale-out-timeout-secs");
    let (parsed, ..) = serve(prefix, &["--config", "v.toml"], "v.toml", "rollout-num-gpus = 16\n").unwrap();
    assert_eq!(parsed.config.validate().unwrap_err().flag, "--gpus");
    let (parsed, ..) = serve(prefix, &["--config", "c.yaml"], "c.yaml", "chunk-tokens: 8\n").unwrap();
    let err = parsed.config.validate().unwrap_err();
    assert_eq!(err.flag, "--chunk-tokens");
    assert!(err.to_string().contains("at least 16"), "{err}");
    for ok in ["chunk-tokens: 0\n", "chunk-tokens: 16\n", "chunk-tokens: 512\n"] {
        let (parsed, ..) = serve(prefix, &["--config", "c.yaml"], "c.yaml", ok).unwrap();
        assert!(parsed.config.validate().is_ok(), "{ok}");
    }
}

#[test]
fn a_fleet_name_sglang_would_read_as_an_adapter_is_refused() {
    let prefix = "RM_TEST_NAMES_";
    for (args, flag_ok) in [
        (&["--model-name", "qwen3:8b"][..], false),
        (&["--model-path", "/models/qwen3:8b"][..], false),
        (&["--model-path", "/models/qwen3:8b", "--model-name", "qwen3-8b"][..], true),
        (&["--model-name", "qwen3-8b"][..], true),
    ] {
        let (parsed, ..) = flat(prefix, args, "").unwrap();
        match parsed.config.validate() {
            Ok(()) => assert!(flag_ok, "{args:?} was accepted"),
            Err(err) => {
                assert!(!flag_ok, "{args:?}: {err}");
                assert_eq!(err.flag, "--model-name", "{args:?}");
                assert!(err.to_string().contains("LoRA adapter"), "{err}");
            }
        }
    }
}

#[test]
fn lists_switches_and_enums_in_both_formats() {
    let prefix = "RM_TEST_SHAPES_";
    let yaml = "engine-arg: [--time-scale=0.1, --startup-delay=2]\nfully-async: true\n\
                restart-failed-engines: false\nplacement: ray\nlog-format: json\nexternal-allow-cidr: 10.0.0.0/8\n";
    let toml = "engine-arg = [\"--time-scale=0.1\", \"--startup-delay=2\"]\nfully-async = true\n\
                restart-failed-engines = false\nplacement = \"ray\"\nlog-format = \"json\"\n\
                external-allow-cidr = \"10.0.0.0/8\"\n";
    for (name, text) in [("s.yaml", yaml), ("s.toml", toml)] {
        let (parsed, log_format, layered) = serve(prefix, &["--config", name], name, text).unwrap();
        let c = &parsed.config;
        assert_eq!(c.engine_args, ["--time-scale=0.1", "--startup-delay=2"], "{name}");
        assert!(c.fully_async && !c.restart_failed_engines, "{name}");
        assert_eq!(c.placement, PlacementMode::Ray, "{name}");
        assert_eq!(c.external_allow_cidr, ["10.0.0.0/8"], "{name}");
        assert_eq!(log_format, LogFormat::Json, "{name}");
        assert_eq!(layered.sources(Some("serve"))["log_format"], Source::ConfigFile, "{name}");
        // A flag replaces the file's list; it does not extend it.
        let (parsed, log_format, _) =
            serve(prefix, &["--config", name, "--engine-arg=--x", "--log-format", "text"], name, text).unwrap();
        assert_eq!(parsed.config.engine_args, ["--x"], "{name}");
        assert_eq!(log_format, LogFormat::Text, "{name}");
        // The same file works when `serve`'s arguments are the whole command (the Python module).
        let (parsed, log_format, layered) = flat(prefix, &["--config", name], text).unwrap();
        assert_eq!(parsed.config.engine_args, ["--time-scale=0.1", "--startup-delay=2"], "{name}");
        assert_eq!(log_format, LogFormat::Json, "{name}");
        assert_eq!(layered.sources(None)["engine_args"], Source::ConfigFile, "{name}");
    }
    let (parsed, ..) = serve(prefix, &["--config", "e.yaml"], "e.yaml", "").unwrap();
    assert_eq!(parsed.config.port, 8000, "an empty file sets nothing");
}

#[test]
fn clap_errors_still_name_the_flag() {
    let prefix = "RM_TEST_CLAP_ERRORS_";
    std::env::set_var(format!("{prefix}ROUTER_PORT"), "not-a-port");
    let err = match serve(prefix, &[], "", "") {
        Err(LayerError::Clap(e)) => e.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(err.contains("--router-port"), "{err}");
    assert!(err.contains(&format!("environment variable {prefix}ROUTER_PORT")), "{err}");
    std::env::remove_var(format!("{prefix}ROUTER_PORT"));
}
