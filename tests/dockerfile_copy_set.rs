//! packaging/docker/Dockerfile must build on any machine with a registry. This cannot build the image
//! here (no registry to pull `rust` from), so it checks what broke it before: the build stage copies
//! exactly its COPY lines' paths (less what .dockerignore keeps out of the context) and runs cargo
//! there; cargo must accept that tree as it is, `--locked`. Once it refused the manifest because the
//! bench target's file was not copied.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The Dockerfile's instructions, one per entry, continuation lines joined and comments dropped.
fn instructions() -> Vec<(String, String)> {
    let text = fs::read_to_string(Path::new(ROOT).join("packaging/docker/Dockerfile")).unwrap();
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && pending.is_empty()) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                pending.push_str(head);
                pending.push(' ');
            }
            None => {
                pending.push_str(trimmed);
                let (keyword, rest) = pending.split_once(char::is_whitespace).unwrap();
                out.push((keyword.to_ascii_uppercase(), rest.trim().to_owned()));
                pending.clear();
            }
        }
    }
    out
}

/// A COPY of the build context in the first (build) stage: sources relative to the context,
/// destination relative to the stage's WORKDIR.
#[derive(Debug)]
struct Copy {
    sources: Vec<String>,
    dest: String,
}

fn build_stage_copies() -> Vec<Copy> {
    let mut copies = Vec::new();
    let mut workdir = String::from("/");
    let mut stage = 0;
    for (keyword, rest) in instructions() {
        match keyword.as_str() {
            "FROM" => stage += 1,
            "WORKDIR" if stage == 1 => workdir = rest.clone(),
            "COPY" | "ADD" if stage == 1 => {
                let words: Vec<String> = if rest.starts_with('[') {
                    serde_json::from_str(&rest).expect("COPY's JSON form")
                } else {
                    rest.split_whitespace().map(str::to_owned).collect()
                };
                let (flags, paths): (Vec<String>, Vec<String>) =
                    words.into_iter().partition(|w| w.starts_with("--"));
                assert!(
                    !flags.iter().any(|f| f.starts_with("--from")),
                    "the build stage copies from another stage: {rest}"
                );
                assert_eq!(keyword, "COPY", "ADD fetches and unpacks; use COPY: {rest}");
                let (dest, sources) = paths.split_last().expect("COPY has a destination");
                let dest = match dest.strip_prefix('/') {
                    Some(absolute) => {
                        let base = workdir.trim_matches('/');
                        let inside = absolute.strip_prefix(base).unwrap_or_else(|| {
                            panic!("COPY outside the WORKDIR {workdir}: {rest}")
                        });
                        format!(".{inside}")
                    }
                    None => dest.clone(),
                };
                copies.push(Copy {
                    sources: sources.to_vec(),
                    dest,
                });
            }
            _ => {}
        }
    }
    assert!(stage >= 2, "a build stage and a runtime stage");
    assert!(!copies.is_empty(), "the build stage copies nothing");
    copies
}

/// .dockerignore, as the engine applies it: patterns in order, the last one matching a path (or any
/// directory above it) decides, `!` re-includes.
struct DockerIgnore(Vec<(bool, Vec<String>)>);

impl DockerIgnore {
    fn load() -> DockerIgnore {
        let text = fs::read_to_string(Path::new(ROOT).join(".dockerignore")).unwrap_or_default();
        DockerIgnore(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(|l| {
                    let (include, pattern) = match l.strip_prefix('!') {
                        Some(p) => (true, p),
                        None => (false, l),
                    };
                    let parts = pattern
                        .trim_matches('/')
                        .split('/')
                        .filter(|p| !p.is_empty() && *p != ".")
                        .map(str::to_owned)
                        .collect();
                    (include, parts)
                })
                .collect(),
        )
    }

    fn excludes(&self, path: &str) -> bool {
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        let mut excluded = false;
        for (include, pattern) in &self.0 {
            let hit = (1..=parts.len()).any(|n| glob_path(pattern, &parts[..n]));
            if hit {
                excluded = !include;
            }
        }
        excluded
    }
}

/// Go's filepath.Match per path element, plus `**` for any number of elements.
fn glob_path(pattern: &[String], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first == "**" => {
            (0..=path.len()).any(|skip| glob_path(rest, &path[skip..]))
        }
        Some((first, rest)) => {
            !path.is_empty()
                && glob(first.as_bytes(), path[0].as_bytes())
                && glob_path(rest, &path[1..])
        }
    }
}

fn glob(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len()).any(|skip| glob(rest, &name[skip..])),
        Some((b'?', rest)) => !name.is_empty() && glob(rest, &name[1..]),
        Some((c, rest)) => name.first() == Some(c) && glob(rest, &name[1..]),
    }
}

/// Copies `from` (a file or a directory's contents) to `to`, as COPY does, leaving out what the
/// context would not contain.
fn copy_like_docker(ignore: &DockerIgnore, context_path: &str, to: &Path) {
    let from = Path::new(ROOT).join(context_path);
    if ignore.excludes(context_path) && !from.is_dir() {
        return;
    }
    if from.is_dir() {
        fs::create_dir_all(to).unwrap();
        for entry in fs::read_dir(&from).unwrap() {
            let name = entry.unwrap().file_name();
            let name = name.to_str().unwrap();
            copy_like_docker(ignore, &format!("{context_path}/{name}"), &to.join(name));
        }
    } else {
        assert!(from.is_file(), "COPY source {context_path} does not exist");
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(&from, to).unwrap();
    }
}

/// The build stage's WORKDIR as the Dockerfile's COPY lines (minus `leave_out`) would fill it.
fn build_context_tree(leave_out: &[&str]) -> tempfile::TempDir {
    let ignore = DockerIgnore::load();
    let dir = tempfile::tempdir().unwrap();
    for copy in build_stage_copies() {
        let into_dir = copy.dest.ends_with('/') || copy.sources.len() > 1;
        for source in copy
            .sources
            .iter()
            .filter(|s| !leave_out.contains(&s.as_str()))
        {
            let source = source.trim_start_matches("./").trim_end_matches('/');
            assert!(
                !ignore.excludes(source),
                ".dockerignore keeps {source} out of the build context"
            );
            let dest: PathBuf = if into_dir {
                dir.path()
                    .join(&copy.dest)
                    .join(Path::new(source).file_name().unwrap())
            } else {
                dir.path().join(&copy.dest)
            };
            copy_like_docker(&ignore, source, &dest);
        }
    }
    dir
}

fn cargo(tree: &Path, args: &[&str]) -> std::process::Output {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    Command::new(cargo)
        .args(args)
        .arg("--manifest-path")
        .arg(tree.join("Cargo.toml"))
        .output()
        .unwrap()
}

fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let out = Command::new(rustc).arg("-vV").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names the host")
        .to_owned()
}

/// Whether cargo accepts `tree` as `cargo build --locked` would, without compiling anything:
/// `cargo metadata --locked --offline` checks the manifest against Cargo.lock, but it silently
/// drops a declared target whose file is missing, so `cargo fetch --locked --offline` (for the host
/// only: other platforms' crates were never downloaded here) parses the manifest as a build does,
/// and refuses it then. Returns cargo's complaint.
fn cargo_refuses(tree: &Path) -> Option<String> {
    let host = host_triple();
    for args in [
        &[
            "metadata",
            "--locked",
            "--offline",
            "--format-version",
            "1",
            "--filter-platform",
            &host,
        ][..],
        &["fetch", "--locked", "--offline", "--target", &host][..],
    ] {
        let out = cargo(tree, args);
        if !out.status.success() {
            return Some(format!(
                "cargo {}: {}",
                args[0],
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    None
}

#[test]
fn the_build_stage_copy_set_is_enough_for_cargo() {
    let tree = build_context_tree(&[]);
    if let Some(complaint) = cargo_refuses(tree.path()) {
        panic!("cargo refuses what the Dockerfile copies: {complaint}");
    }
    // And the tree holds the sources that cargo build compiles, not just a manifest.
    assert!(tree.path().join("src/main.rs").is_file());
}

#[test]
fn the_check_catches_a_copy_set_missing_a_target() {
    // The copy set that broke the Dockerfile before: no benches/, which Cargo.toml names.
    let tree = build_context_tree(&["benches"]);
    let complaint = cargo_refuses(tree.path()).unwrap_or_default();
    assert!(
        complaint.contains("can't find `guard` bench"),
        "cargo accepted a tree without the bench target ({complaint:?})"
    );
}

#[test]
fn dockerignore_keeps_build_output_out_of_the_context() {
    let ignore = DockerIgnore::load();
    for path in [
        "target/release/sentinel-guard",
        ".git/HEAD",
        "docs/design.md",
    ] {
        assert!(ignore.excludes(path), ".dockerignore lets {path} in");
    }
    for path in [
        "Cargo.toml",
        "src/main.rs",
        "src/backend/mysql.rs",
        "benches/guard.rs",
    ] {
        assert!(!ignore.excludes(path), ".dockerignore keeps {path} out");
    }
}

#[test]
fn the_runtime_stage_is_unprivileged_and_labelled_with_the_crate_version() {
    let all = instructions();
    let last_from = all.iter().rposition(|(k, _)| k == "FROM").unwrap();
    let runtime = &all[last_from..];
    let user = runtime
        .iter()
        .rev()
        .find(|(k, _)| k == "USER")
        .map(|(_, u)| u.as_str())
        .expect("the runtime stage sets a USER");
    let uid = user.split(':').next().unwrap();
    assert!(
        uid != "root" && uid != "0",
        "the runtime stage runs as {user}"
    );
    let version = format!("VERSION={}", env!("CARGO_PKG_VERSION"));
    assert!(
        runtime.iter().any(|(k, v)| k == "ARG" && *v == version),
        "ARG {version} (the OCI version label) is not in step with Cargo.toml"
    );
    let labels: String = runtime
        .iter()
        .filter(|(k, _)| k == "LABEL")
        .map(|(_, v)| v.as_str())
        .collect();
    for key in ["title", "description", "version", "revision", "licenses"] {
        assert!(
            labels.contains(&format!("org.opencontainers.image.{key}=")),
            "OCI label {key} is missing"
        );
    }
}
