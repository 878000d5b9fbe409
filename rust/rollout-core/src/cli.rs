//! Where `rollout-manager serve`'s settings come from: the command line, the environment, a
//! `--config` file, the defaults; in that order of precedence.
//!
//! # Flow
//!
//! 1. [`with_env`] gives every long flag an environment variable, `ROLLOUT_MANAGER_` and the flag
//!    in upper snake case (`--scale-out-timeout-secs`: `ROLLOUT_MANAGER_SCALE_OUT_TIMEOUT_SECS`);
//!    clap reads it and shows it in `--help`.
//! 2. [`layered_matches`] finds `--config FILE` (or `ROLLOUT_MANAGER_CONFIG`) with a forgiving
//!    first pass of the same parser, reads the file through the caller's function, and checks it
//!    ([`ConfigFile::parse`]): YAML or TOML by extension, a flat mapping whose keys are the flags'
//!    long names (dashes, no leading `--`; an alias such as `scale-out-timeout` works too).
//! 3. Each value of the file goes through its flag's own parser, then becomes that flag's
//!    default; clap then parses the command line once: a flag given there wins, else its
//!    environment variable, else the file, else the built-in default.
//!
//! # Guarantees
//!
//! - One parser: clap parses and checks every value, whatever its source, and
//!   `ServeConfig::validate` runs on the result as before.
//! - Every error names the flag; an error in the file also names the file and the key.
//! - A list in the file (`engine-arg: [...]`) is replaced, not extended, by the flag or its
//!   environment variable.
//!
//! # Errors
//!
//! [`LayerError::Clap`]: clap's own error (unknown flag, bad value, `--help`), to be shown with
//! `Error::exit` or `Error::render`. [`LayerError::File`]: the file cannot be read, has an
//! unsupported extension, does not parse, or has an unknown key or a bad value.
//!
//! Nothing here touches the file system or the environment itself, except clap's own lookup of
//! the environment variables.

use crate::config::{heading, ServeConfig};
use clap::builder::{ArgAction, Resettable};
use clap::parser::ValueSource;
use clap::{Arg, ArgMatches, Args, Command, ValueEnum};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Prefix of the environment variables of `serve`'s flags and of the global flags.
pub const ENV_PREFIX: &str = "ROLLOUT_MANAGER_";
/// Prefix of `rollout-manager agent`'s: its `--state-dir`, `--relay-dir` and `--api-token-file`
/// are the node's own, and must not be taken from a manager's settings on the same machine.
pub const AGENT_ENV_PREFIX: &str = "ROLLOUT_MANAGER_AGENT_";
/// Prefix of `rollout-manager monitor`'s.
pub const MONITOR_ENV_PREFIX: &str = "ROLLOUT_MANAGER_MONITOR_";

/// Format of the log on stderr (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Lines for people.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Flags of every long-running command (`serve`, `agent`).
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Format of the log on stderr: `text`, or `json` (one object per line).
    ///
    /// RUST_LOG still picks what is logged (default `info`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, help_heading = heading::STATE)]
    pub log_format: LogFormat,
}

/// `rollout-manager serve`'s arguments: the settings, and the file some of them may come from.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub config: ServeConfig,
    /// YAML (.yaml, .yml) or TOML (.toml) file of `serve` flags; flags and their environment
    /// variables override it.
    ///
    /// Keys are the flags' long names without the dashes in front (`scale-out-timeout-secs: 600`,
    /// `engine-arg: [--time-scale=0.1]`); an unknown key is an error. Relative paths in it are
    /// taken from the working directory, as on the command line.
    // After the settings, so that its heading (the one of --state-dir) comes last in --help.
    #[arg(long = "config", value_name = "FILE", help_heading = heading::STATE)]
    pub config_file: Option<PathBuf>,
}

/// The argument id of `--config` (the field name of [`ServeArgs::config_file`]).
const CONFIG_FILE_ID: &str = "config_file";
/// The argument id of `--log-format`, the one global flag a config file may set.
const LOG_FORMAT_ID: &str = "log_format";

/// The environment variable of a long flag: `prefix` and the flag in upper snake case.
pub fn env_name(prefix: &str, long: &str) -> String {
    format!("{prefix}{}", long.to_ascii_uppercase().replace('-', "_"))
}

/// Gives every long flag of `cmd` itself (not of its subcommands) the environment variable
/// [`env_name`]`(prefix, flag)`, unless it has one already.
///
/// `--help` shows `[env: NAME=value]` for a variable that is set (`[env: NAME]` for a flag with
/// `hide_env_values`, whose value may be a secret), `[env: NAME]` for one that is not.
pub fn with_env(cmd: Command, prefix: &str) -> Command {
    cmd.mut_args(|arg| {
        let Some(long) = arg.get_long() else { return arg };
        let (arg, name) = match arg.get_env() {
            Some(name) => {
                let name = name.to_os_string();
                (arg, name)
            }
            None => {
                let name = OsString::from(env_name(prefix, long));
                (arg.env(name.clone()), name)
            }
        };
        if std::env::var_os(&name).is_none() {
            arg.hide_env_values(true)
        } else {
            arg
        }
    })
}

/// A problem with the `--config` file. Each message names `--config` and the file; one about a
/// key names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("invalid --config {}: expected a .yaml, .yml or .toml file", path.display())]
    Extension { path: PathBuf },
    #[error("cannot read --config {}: {source}", path.display())]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid --config {}: {message}", path.display())]
    Syntax { path: PathBuf, message: String },
    #[error("invalid --config {}: unknown key `{key}`; {hint}", path.display())]
    UnknownKey { path: PathBuf, key: String, hint: String },
    #[error("invalid --config {}: key `{key}`: {message}", path.display())]
    Value { path: PathBuf, key: String, message: String },
}

/// The `--config` file's entries, checked for shape (not yet against the flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigFile {
    pub path: PathBuf,
    /// Each key as written, with its value, in the file's order.
    pub entries: Vec<(String, FileValue)>,
}

/// One value of the file, as the text a flag would be given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileValue {
    Scalar(String),
    /// For a repeatable flag (`engine-arg`, `external-allow-cidr`): one value per occurrence.
    List(Vec<String>),
}

enum Format {
    Yaml,
    Toml,
}

impl ConfigFile {
    /// Parses the text of `path`, YAML or TOML by its extension. An empty file sets nothing.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigFileError> {
        let format = match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("yaml" | "yml") => Format::Yaml,
            Some("toml") => Format::Toml,
            _ => return Err(ConfigFileError::Extension { path: path.to_path_buf() }),
        };
        let entries = match format {
            Format::Yaml => yaml_entries(path, text)?,
            Format::Toml => toml_entries(path, text)?,
        };
        Ok(Self { path: path.to_path_buf(), entries })
    }

    fn value_error(&self, key: &str, message: impl Into<String>) -> ConfigFileError {
        ConfigFileError::Value { path: self.path.clone(), key: key.to_string(), message: message.into() }
    }
}

fn syntax(path: &Path, message: impl Into<String>) -> ConfigFileError {
    ConfigFileError::Syntax { path: path.to_path_buf(), message: message.into() }
}

fn yaml_entries(path: &Path, text: &str) -> Result<Vec<(String, FileValue)>, ConfigFileError> {
    use serde_norway::Value;
    let doc: Value = serde_norway::from_str(text).map_err(|e| syntax(path, e.to_string()))?;
    let map = match doc {
        Value::Null => return Ok(Vec::new()),
        Value::Mapping(map) => map,
        _ => return Err(syntax(path, "expected a mapping of flag names to values at the top level")),
    };
    let scalar = |key: &str, v: &Value| -> Result<String, ConfigFileError> {
        match v {
            Value::Bool(b) => Ok(b.to_string()),
            Value::Number(n) => Ok(n.to_string()),
            Value::String(s) => Ok(s.clone()),
            Value::Null => Err(value_shape(path, key, "has no value; remove the key to keep the default")),
            _ => Err(value_shape(path, key, "expected a string, a number or a boolean")),
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in &map {
        let Value::String(key) = k else {
            return Err(syntax(path, format!("key {k:?} is not a string; keys are flag names")));
        };
        let value = match v {
            Value::Sequence(items) => {
                FileValue::List(items.iter().map(|item| scalar(key, item)).collect::<Result<_, _>>()?)
            }
            other => FileValue::Scalar(scalar(key, other)?),
        };
        out.push((key.clone(), value));
    }
    Ok(out)
}

fn toml_entries(path: &Path, text: &str) -> Result<Vec<(String, FileValue)>, ConfigFileError> {
    use toml_edit::{Item, Value};
    let doc = toml_edit::Document::parse(text).map_err(|e| syntax(path, e.to_string().trim_end()))?;
    let Some(table) = doc.as_item().as_table() else {
        return Err(syntax(path, "expected a table of flag names to values at the top level"));
    };
    let scalar = |key: &str, v: &Value| -> Result<String, ConfigFileError> {
        match v {
            Value::String(s) => Ok(s.value().clone()),
            Value::Integer(i) => Ok(i.value().to_string()),
            Value::Float(f) => Ok(f.value().to_string()),
            Value::Boolean(b) => Ok(b.value().to_string()),
            _ => Err(value_shape(path, key, "expected a string, a number or a boolean")),
        }
    };
    let mut out = Vec::new();
    for (key, item) in table.iter() {
        let value = match item {
            Item::Value(Value::Array(items)) => {
                FileValue::List(items.iter().map(|item| scalar(key, item)).collect::<Result<_, _>>()?)
            }
            Item::Value(v) => FileValue::Scalar(scalar(key, v)?),
            _ => return Err(value_shape(path, key, "expected a value, not a table (the file is flat)")),
        };
        out.push((key.to_string(), value));
    }
    Ok(out)
}

fn value_shape(path: &Path, key: &str, message: &str) -> ConfigFileError {
    ConfigFileError::Value { path: path.to_path_buf(), key: key.to_string(), message: message.to_string() }
}

/// A parse that could not go on.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// clap's error (or `--help`/`--version`): show it with `Error::exit` or `Error::render`.
    #[error("{0}")]
    Clap(#[from] clap::Error),
    #[error(transparent)]
    File(#[from] ConfigFileError),
}

/// Where a setting's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    CommandLine,
    Env,
    ConfigFile,
    Default,
}

/// The result of [`layered_matches`].
#[derive(Debug)]
pub struct Layered {
    pub matches: ArgMatches,
    /// The `--config` file, if one was given.
    pub file: Option<ConfigFile>,
    /// The command as parsed (with the file's values as defaults).
    command: Command,
    /// Ids of the arguments the file set.
    from_file: Vec<String>,
}

/// Parses `argv` (the program name first) with `cmd`, layering the command line over the
/// environment over the `--config` file over the defaults (see the module docs).
///
/// `serve` names the subcommand that has `--config` ([`ServeArgs`] flattened in it), or is
/// `None` when `cmd` is that command itself. `read` reads the file.
pub fn layered_matches(
    cmd: Command,
    argv: &[OsString],
    serve: Option<&str>,
    read: impl FnOnce(&Path) -> std::io::Result<String>,
) -> Result<Layered, LayerError> {
    let (cmd, file, from_file) = match config_path(&cmd, argv, serve) {
        Some(path) => {
            let text = read(&path).map_err(|source| ConfigFileError::Read { path: path.clone(), source })?;
            let file = ConfigFile::parse(&path, &text)?;
            let (cmd, from_file) = apply_file(cmd, serve, &file)?;
            (cmd, Some(file), from_file)
        }
        None => (cmd, None, Vec::new()),
    };
    let matches = cmd.clone().try_get_matches_from(argv).map_err(|e| name_the_variable(e, &cmd, serve))?;
    Ok(Layered { matches, file, command: cmd, from_file })
}

/// A bad value that came from an environment variable: clap's message names the flag; add a
/// tip naming the variable, which the user may not know is set.
fn name_the_variable(mut error: clap::Error, cmd: &Command, serve: Option<&str>) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(error.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation) {
        return error;
    }
    let (Some(ContextValue::String(arg)), Some(ContextValue::String(value))) =
        (error.get(ContextKind::InvalidArg), error.get(ContextKind::InvalidValue))
    else {
        return error;
    };
    let long = arg.trim_start_matches('-').split([' ', '=']).next().unwrap_or_default();
    let target = serve.and_then(|name| cmd.find_subcommand(name)).unwrap_or(cmd);
    let Some(variable) = target
        .get_arguments()
        .chain(cmd.get_arguments())
        .find(|a| a.get_long() == Some(long))
        .and_then(Arg::get_env)
        .map(std::ffi::OsStr::to_os_string)
    else {
        return error;
    };
    if std::env::var_os(&variable).is_some_and(|v| v == value.as_str()) {
        let tip = format!("the value comes from the environment variable {}", variable.to_string_lossy());
        error.insert(ContextKind::Suggested, ContextValue::StyledStrs(vec![tip.into()]));
    }
    error
}

impl Layered {
    /// Where each argument of `serve` (see [`layered_matches`]) got its value, by argument id
    /// (`ServeConfig`'s field names, plus `config_file` and `log_format`). Empty when the command
    /// line chose another subcommand.
    pub fn sources(&self, serve: Option<&str>) -> BTreeMap<String, Source> {
        let (cmd, matches) = match serve {
            Some(name) => match (self.command.find_subcommand(name), self.matches.subcommand_matches(name)) {
                (Some(cmd), Some(matches)) => (cmd, matches),
                _ => return BTreeMap::new(),
            },
            None => (&self.command, &self.matches),
        };
        let root_log_format = self.command.get_arguments().find(|a| a.get_id() == LOG_FORMAT_ID);
        let mut out = BTreeMap::new();
        for arg in cmd.get_arguments().chain(root_log_format.filter(|_| serve.is_some())) {
            let id = arg.get_id().as_str();
            let from = if serve.is_some() && id == LOG_FORMAT_ID { &self.matches } else { matches };
            let source = match from.value_source(id) {
                Some(ValueSource::CommandLine) => Source::CommandLine,
                Some(ValueSource::EnvVariable) => Source::Env,
                _ if self.from_file.iter().any(|f| f == id) => Source::ConfigFile,
                _ => Source::Default,
            };
            out.insert(id.to_string(), source);
        }
        out
    }
}

/// The `--config` path, from a first pass that ignores every error (the real parse reports
/// them; `--help` and `--version` end the first pass, so help shows the built-in defaults).
fn config_path(cmd: &Command, argv: &[OsString], serve: Option<&str>) -> Option<PathBuf> {
    let matches = cmd.clone().ignore_errors(true).try_get_matches_from(argv).ok()?;
    let matches = match serve {
        Some(name) => matches.subcommand_matches(name)?,
        None => &matches,
    };
    matches.try_get_one::<PathBuf>(CONFIG_FILE_ID).ok().flatten().cloned()
}

/// The file's values, checked by their flags' parsers, as defaults of `cmd`. Returns the
/// command and the ids of the arguments the file set.
fn apply_file(cmd: Command, serve: Option<&str>, file: &ConfigFile) -> Result<(Command, Vec<String>), ConfigFileError> {
    let target = match serve {
        Some(name) => cmd.find_subcommand(name).unwrap_or(&cmd),
        None => &cmd,
    };
    // (id, values, on the root command)
    let mut defaults: Vec<(String, Vec<String>, bool)> = Vec::new();
    let mut seen: Vec<(String, String)> = Vec::new();
    for (key, value) in &file.entries {
        let own = target.get_arguments().find(|a| a.get_id() != CONFIG_FILE_ID && named(a, key));
        let global = || cmd.get_arguments().find(|a| serve.is_some() && a.get_id() == LOG_FORMAT_ID && named(a, key));
        let (arg, on_root) = match (own, global()) {
            (Some(arg), _) => (arg, false),
            (None, Some(arg)) => (arg, true),
            (None, None) => {
                return Err(ConfigFileError::UnknownKey {
                    path: file.path.clone(),
                    key: key.clone(),
                    hint: unknown_key_hint(target, key),
                })
            }
        };
        let id = arg.get_id().to_string();
        if let Some((other, _)) = seen.iter().find(|(_, seen_id)| *seen_id == id) {
            let flag = arg.get_long().unwrap_or_default();
            return Err(file.value_error(key, format!("sets --{flag} again (also set by `{other}`)")));
        }
        seen.push((key.clone(), id.clone()));
        let values = checked_values(arg, key, value, file)?;
        defaults.push((id, values, on_root));
    }
    let ids = defaults.iter().map(|(id, ..)| id.clone()).collect();
    let mut cmd = cmd;
    for (id, values, on_root) in defaults {
        // A flag with `hide_default_value` (one whose value may be a secret) keeps it hidden.
        let set = move |arg: Arg| arg.default_values(values);
        cmd = match (serve, on_root) {
            (Some(name), false) => cmd.mut_subcommand(name, |sub| sub.mut_arg(&id, set)),
            _ => cmd.mut_arg(&id, set),
        };
    }
    Ok((cmd, ids))
}

/// Whether `key` is the long name of `arg` or one of its aliases.
fn named(arg: &Arg, key: &str) -> bool {
    arg.get_long() == Some(key) || arg.get_all_aliases().is_some_and(|aliases| aliases.contains(&key))
}

fn unknown_key_hint(target: &Command, key: &str) -> String {
    if key == "config" {
        return "a config file cannot name another one".to_string();
    }
    let dashed = key.trim_start_matches('-').replace('_', "-");
    if dashed != key && target.get_arguments().any(|a| a.get_id() != CONFIG_FILE_ID && named(a, &dashed)) {
        return format!("keys are spelled as the flags, with dashes: `{dashed}`");
    }
    "keys are the long names of `rollout-manager serve --help`'s flags without the leading dashes, e.g. \
     `max-engines`"
        .to_string()
}

/// The file's value for `arg` as the flag's values, after the flag's own parser accepted them.
fn checked_values(arg: &Arg, key: &str, value: &FileValue, file: &ConfigFile) -> Result<Vec<String>, ConfigFileError> {
    let long = arg.get_long().unwrap_or_default();
    let repeatable = matches!(arg.get_action(), ArgAction::Append);
    let values = match value {
        FileValue::Scalar(v) => vec![v.clone()],
        FileValue::List(items) if repeatable => items.clone(),
        FileValue::List(_) => return Err(file.value_error(key, format!("--{long} takes one value, not a list"))),
    };
    // The values as they would be written on a command line, for the flag's own parser.
    let argv: Vec<String> = match arg.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse => match values.as_slice() {
            [v] if v == "true" => vec![format!("--{long}")],
            [v] if v == "false" => Vec::new(),
            _ => return Err(file.value_error(key, format!("--{long} is a switch: expected true or false"))),
        },
        _ => values.iter().map(|v| format!("--{long}={v}")).collect(),
    };
    let probe = Command::new("rollout-manager")
        .no_binary_name(true)
        .arg(arg.clone().env(Resettable::Reset).default_values(Vec::<String>::new()).required(false));
    probe.try_get_matches_from(argv).map_err(|e| file.value_error(key, first_line(&e)))?;
    Ok(values)
}

/// The first line of a clap error, without its `error: ` prefix.
fn first_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let line = text.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

#[cfg(test)]
#[path = "cli_tests.rs"]
mod tests;
