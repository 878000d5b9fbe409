//! The dependency rule of `rollout-manager` (docs/architecture.md, "Layers"): `src/` has one
//! folder per layer and every module is in one; a module may use modules of its own layer or of
//! lower ones, never of a higher one, and no modules use each other in a circle.
//!
//! Checked on the source text: every `crate::<layer>::<module>` path outside comments and
//! outside the `#[cfg(test)]` part of a file (tests may reach anywhere). A module's layer is the
//! folder it is in; a new folder must be given its place in [`LAYERS`].
//!
//! Also the length of functions: none outside tests is over [`MAX_FUNCTION_LINES`] lines, so
//! each reads on one screen and says what it does in its name (a long one is split into steps
//! that do).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layer folders of `src/`, lowest first.
const LAYERS: [&str; 6] = ["foundation", "registry", "adapters", "ops", "interfaces", "app"];

/// The files of `src/` outside the layers: the crate root, the binary, and what is compiled only
/// for `cargo test` (fakes behind the seams, the use cases' unit tests), which may use any layer.
const OUTSIDE: [&str; 4] = ["lib.rs", "main.rs", "testing.rs", "use_case_tests.rs"];

/// Most lines of a function of `src/` outside tests, its signature and closing brace included.
const MAX_FUNCTION_LINES: usize = 100;

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| module.split("::").next() == Some(*l))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display())) {
        let path = entry.map(|e| e.path()).unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file that counts: before its `#[cfg(test)]` part, without comment lines.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The paths `code` names as `crate::<a>::<b>`, as `a::b` (`a` alone when no `::<b>` follows).
fn used_modules(code: &str) -> BTreeSet<String> {
    let word = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    code.match_indices("crate::")
        .filter_map(|(i, m)| {
            let rest = &code[i + m.len()..];
            let first = word(rest);
            if first.is_empty() {
                return None;
            }
            let second = rest[first.len()..].strip_prefix("::").map(word).filter(|w| !w.is_empty());
            Some(match second {
                Some(second) => format!("{first}::{second}"),
                None => first,
            })
        })
        .collect()
}

/// Every module of `src/` (as `layer::module`) with the paths it uses; files outside a layer
/// folder that are not in [`OUTSIDE`] are listed under their own name.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap_or(&file);
        let parts: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().to_string()).collect();
        let module = match parts.as_slice() {
            [one] if OUTSIDE.contains(&one.as_str()) => continue,
            [one] => one.trim_end_matches(".rs").to_string(),
            [layer, rest @ ..] if rest.first().is_some_and(|r| r == "mod.rs") => layer.clone(),
            [layer, module, ..] => format!("{layer}::{}", module.trim_end_matches(".rs")),
            [] => continue,
        };
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        let uses = used_modules(&code(&text));
        let entry = graph.entry(module.clone()).or_default();
        entry.extend(uses.into_iter().filter(|u| *u != module));
    }
    graph
}

#[test]
fn every_module_is_in_a_layer_folder_and_uses_none_above_it() {
    let graph = module_graph();
    let mut wrong = Vec::new();
    for (module, uses) in &graph {
        let Some(own) = layer_of(module) else {
            wrong.push(format!("src/{module} is in no layer folder: move it into one of {LAYERS:?}"));
            continue;
        };
        for used in uses {
            match layer_of(used) {
                Some(layer) if layer > own => {
                    wrong.push(format!("{module} ({}) uses {used} ({}), a higher layer", LAYERS[own], LAYERS[layer]))
                }
                Some(_) => {}
                None => wrong.push(format!("{module} uses crate::{used}, which is in no layer")),
            }
        }
    }
    assert!(wrong.is_empty(), "the dependency rule is broken:\n{}", wrong.join("\n"));
}

#[test]
fn no_modules_use_each_other_in_a_circle() {
    let graph = module_graph();
    // Depth-first search with colours; a grey module met again closes a circle.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        colour: &mut BTreeMap<&'a str, u8>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        colour.insert(m, 1);
        path.push(m);
        for next in graph.get(m).into_iter().flatten() {
            let next = next.as_str();
            if !graph.contains_key(next) {
                continue;
            }
            match colour.get(next).copied().unwrap_or(0) {
                1 => {
                    let start = path.iter().position(|p| *p == next).unwrap_or(0);
                    let mut circle: Vec<String> = path[start..].iter().map(|s| s.to_string()).collect();
                    circle.push(next.to_string());
                    return Some(circle);
                }
                0 => {
                    if let Some(circle) = visit(next, graph, colour, path) {
                        return Some(circle);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        colour.insert(m, 2);
        None
    }
    let mut colour = BTreeMap::new();
    for m in graph.keys() {
        if colour.get(m.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(circle) = visit(m, &graph, &mut colour, &mut Vec::new()) {
                panic!("modules use each other in a circle: {}", circle.join(" -> "));
            }
        }
    }
}

/// Whether `line` starts a function definition: `fn`, after any of `pub`, `pub(..)`, `async`,
/// `const`, `unsafe`, with a body (not a trait's declaration ending in `;`).
fn starts_function(line: &str) -> bool {
    let mut rest = line.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix("pub(") {
            rest = after.split_once(')').map_or("", |(_, r)| r).trim_start();
            continue;
        }
        let Some(word) = ["pub ", "async ", "const ", "unsafe "].iter().find(|w| rest.starts_with(**w)) else { break };
        rest = rest[word.len()..].trim_start();
    }
    rest.starts_with("fn ") && !line.trim_end().ends_with(';')
}

/// The functions of `text` (before its `#[cfg(test)]` part) over `max` lines: (line, name, length).
/// A function ends at the first line after it that is its closing brace at its indentation, as
/// rustfmt writes it.
fn long_functions(text: &str, max: usize) -> Vec<(usize, String, usize)> {
    let text = text.split("\n#[cfg(test)]").next().unwrap_or("");
    let lines: Vec<&str> = text.lines().collect();
    let mut long = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if !starts_function(line) {
            continue;
        }
        let indent = &line[..line.len() - line.trim_start().len()];
        let closing = format!("{indent}}}");
        let end = if line.trim_end().ends_with('}') {
            Some(i)
        } else {
            lines[i + 1..].iter().position(|l| *l == closing).map(|n| i + 1 + n)
        };
        let Some(end) = end else { continue };
        let length = end - i + 1;
        if length > max {
            let name = line.split("fn ").nth(1).unwrap_or("").split(['(', '<']).next().unwrap_or("").to_string();
            long.push((i + 1, name, length));
        }
    }
    long
}

#[test]
fn no_function_is_over_the_line_limit() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut over = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap_or(&file);
        // Compiled only for tests (see LAYERS).
        if ["testing.rs", "use_case_tests.rs"].iter().any(|t| rel.ends_with(t)) {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        for (line, name, length) in long_functions(&text, MAX_FUNCTION_LINES) {
            over.push(format!("{}:{line} {name}: {length} lines", rel.display()));
        }
    }
    assert!(
        over.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines; split them into steps named for what they do:\n{}",
        over.join("\n")
    );
}

#[test]
fn the_length_checker_measures_functions_and_skips_declarations_and_tests() {
    let text = "pub(crate) async fn long() {\n    a();\n    b();\n}\n\
                fn one_line() { a() }\n\
                trait T {\n    fn declared(&self);\n}\n\
                impl X {\n    pub fn method(&self) {\n        a();\n        b();\n        c();\n    }\n}\n\
                #[cfg(test)]\nmod tests {\n    fn in_tests() {\n        a();\n        b();\n        c();\n    }\n}";
    assert_eq!(long_functions(text, 3), vec![(1, "long".to_string(), 4), (10, "method".to_string(), 5)]);
    assert!(long_functions(text, 5).is_empty());
}

#[test]
fn the_checker_sees_a_use_and_ignores_comments_and_tests() {
    let text = "use crate::registry::fleet::Fleet;\n// crate::app::server in a comment\nfn f() { crate::foundation::clock::unix_now(); }\n\
                #[cfg(test)]\nmod tests { use crate::app::server; }";
    let uses = used_modules(&code(text));
    assert_eq!(uses.into_iter().collect::<Vec<_>>(), ["foundation::clock", "registry::fleet"]);
}
