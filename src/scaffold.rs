//! `dedupd handler new`: writes a standalone handler project.
//!
//! A Rust project builds outside this repository with one command (`cargo build --release
//! --target wasm32-wasip2`): it is a cargo workspace of its own holding the handler crate
//! and a vendored copy of the guest SDK, with the WIT contract copied next to it. A Python
//! project (`--lang python`) holds `app.py`, the vendored Python SDK module and the WIT,
//! and builds with componentize-py (the version `plugins/build-python.sh` pins). The SDK
//! sources, the WIT file, the guest workspace's dependency versions, release profile and
//! lock file are embedded from `plugins/` and `wit/` at compile time, so a generated
//! project always matches the SDK and contract of the binary that wrote it.

use std::fmt;
use std::path::{Path, PathBuf};

use toml::{Table, Value};

/// The guest workspace (`plugins/Cargo.toml`): dependency versions and release profile.
const PLUGINS_MANIFEST: &str = include_str!("../plugins/Cargo.toml");
/// The guest workspace's lock file: the versions the SDK is built and tested with.
const PLUGINS_LOCK: &str = include_str!("../plugins/Cargo.lock");
const SDK_MANIFEST: &str = include_str!("../plugins/sdk/Cargo.toml");
const SDK_LIB: &str = include_str!("../plugins/sdk/src/lib.rs");
const WIT: &str = include_str!("../wit/handler.wit");

const RUST_LIB: &str = include_str!("scaffold/rust/lib.rs");
const RUST_README: &str = include_str!("scaffold/rust/README.md");
const RUST_EVENTS: &str = include_str!("scaffold/rust/events.jsonl");
const RUST_GITIGNORE: &str = include_str!("scaffold/rust/gitignore");
/// What `dedupd handler test --json` prints for `events.jsonl`: the Rust and the Python
/// template do the same, so they share it (each template's build test runs `--expect`).
const EXPECTED: &str = include_str!("scaffold/expected.jsonl");

const PY_SDK: &str = include_str!("../plugins/sdk-python/dedupd_sdk.py");
const PY_APP: &str = include_str!("scaffold/python/app.py");
const PY_README: &str = include_str!("scaffold/python/README.md");
const PY_GITIGNORE: &str = include_str!("scaffold/python/gitignore");
/// The componentize-py version the Python SDK is built and tested with (the one
/// `plugins/build-python.sh` installs; a test keeps the two equal).
pub(crate) const COMPONENTIZE_PY_VERSION: &str = "0.25.1";

/// Where the SDK finds the WIT in this repository, and where it is in a generated project
/// (both relative to the SDK's manifest directory).
const SDK_WIT_PATH: &str = r#"path: "../../wit","#;
const PROJECT_WIT_PATH: &str = r#"path: "../wit","#;
const SDK_WIT_COMMENT: &str = "the WIT lives in ../../wit.";
const PROJECT_WIT_COMMENT: &str = "the WIT lives in ../wit.";

/// The language of a generated handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    /// A Rust crate on the dedupd SDK.
    Rust,
    /// A Python module on the dedupd Python SDK, built with componentize-py.
    Python,
}

impl std::str::FromStr for Lang {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "rust" => Ok(Lang::Rust),
            "python" => Ok(Lang::Python),
            other => Err(Error::Lang(format!(
                "unknown language {other:?}; choose rust or python"
            ))),
        }
    }
}

/// Why a project was not written.
#[derive(Debug)]
pub enum Error {
    /// NAME is not a usable crate name.
    Name(String),
    /// `--lang` names a language without a template.
    Lang(String),
    /// The target directory exists and is not empty.
    Exists(PathBuf),
    /// Reading or writing the filesystem failed.
    Io(PathBuf, std::io::Error),
    /// The embedded SDK or workspace could not be turned into a project (a build bug).
    Template(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Name(m) | Error::Lang(m) => f.write_str(m),
            Error::Exists(p) => write!(
                f,
                "{} exists and is not empty; choose another NAME or --dir",
                p.display()
            ),
            Error::Io(p, e) => write!(f, "{}: {e}", p.display()),
            Error::Template(m) => write!(f, "handler template: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// A project written by [`create`].
#[derive(Debug)]
pub struct Project {
    /// The project directory (`DIR/NAME`).
    pub dir: PathBuf,
    /// The crate name as given.
    pub name: String,
    /// The component's file name (`NAME` with `-` as `_`, `.wasm`).
    pub(crate) wasm: String,
    pub(crate) lang: Lang,
    /// The files written, relative to `dir`, in writing order.
    pub files: Vec<&'static str>,
}

impl Project {
    /// The component's path relative to the project directory after the documented build.
    pub(crate) fn wasm_path(&self) -> String {
        match self.lang {
            Lang::Rust => format!("target/wasm32-wasip2/release/{}", self.wasm),
            Lang::Python => self.wasm.clone(),
        }
    }

    /// What to run next, one command a line, from the directory `new` was run in.
    pub fn next_steps(&self) -> String {
        let wasm = self.wasm_path();
        let dir = self.dir.display();
        match self.lang {
            Lang::Rust => format!(
                "cd {dir}\n\
                 rustup target add wasm32-wasip2    # once\n\
                 cargo build --release --target wasm32-wasip2\n\
                 dedupd handler check {wasm}\n\
                 dedupd handler test {wasm} --input events.jsonl --expect expected.jsonl\n"
            ),
            Lang::Python => format!(
                "cd {dir}\n\
                 python3 -m venv .venv && .venv/bin/pip install componentize-py=={COMPONENTIZE_PY_VERSION}    # once\n\
                 .venv/bin/componentize-py -d wit -w dedupd-handler componentize app -o {wasm}\n\
                 dedupd handler check {wasm}\n\
                 dedupd handler test {wasm} --input events.jsonl --cpu-budget 100ms --expect expected.jsonl\n"
            ),
        }
    }
}

/// Checks that `name` can be a crate (and package) name; the error says why not.
pub(crate) fn validate_name(name: &str) -> Result<(), Error> {
    let bad = |why: &str| Err(Error::Name(format!("invalid handler name {name:?}: {why}")));
    let Some(first) = name.chars().next() else {
        return bad("it is empty");
    };
    if name.len() > 64 {
        return bad("it is longer than 64 characters");
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        return bad(&format!(
            "{c:?} is not allowed; use ASCII letters, digits, '-' and '_'"
        ));
    }
    if !first.is_ascii_alphabetic() {
        return bad("it must start with a letter");
    }
    let ident = name.replace('-', "_");
    if RESERVED.contains(&ident.as_str()) {
        return bad("it is a Rust keyword or a name cargo reserves");
    }
    if ident == "dedupd_sdk" {
        return bad("it is the SDK's own name");
    }
    Ok(())
}

/// Keywords (the crate name becomes an identifier) and names cargo refuses for packages.
const RESERVED: &[&str] = &[
    "abstract",
    "as",
    "async",
    "await",
    "become",
    "box",
    "break",
    "const",
    "continue",
    "crate",
    "do",
    "dyn",
    "else",
    "enum",
    "extern",
    "false",
    "final",
    "fn",
    "for",
    "gen",
    "if",
    "impl",
    "in",
    "let",
    "loop",
    "macro",
    "match",
    "mod",
    "move",
    "mut",
    "override",
    "priv",
    "pub",
    "ref",
    "return",
    "self",
    "static",
    "struct",
    "super",
    "trait",
    "true",
    "try",
    "type",
    "typeof",
    "union",
    "unsafe",
    "unsized",
    "use",
    "virtual",
    "where",
    "while",
    "yield",
    "alloc",
    "core",
    "std",
    "proc_macro",
    "test",
    "build",
    "deps",
    "examples",
    "incremental",
    "con",
    "prn",
    "aux",
    "nul",
    "com1",
    "com2",
    "com3",
    "com4",
    "lpt1",
    "lpt2",
    "lpt3",
];

/// The files of a project named `name`, as (relative path, contents).
pub(crate) fn files(name: &str, lang: Lang) -> Result<Vec<(&'static str, String)>, Error> {
    validate_name(name)?;
    let crate_name = name.replace('-', "_");
    let fill = |t: &str| {
        t.replace("{{name}}", name)
            .replace("{{crate_name}}", &crate_name)
            .replace("{{componentize_py}}", COMPONENTIZE_PY_VERSION)
    };
    if lang == Lang::Python {
        return Ok(vec![
            ("app.py", fill(PY_APP)),
            ("dedupd_sdk.py", PY_SDK.to_string()),
            ("wit/handler.wit", WIT.to_string()),
            ("events.jsonl", RUST_EVENTS.to_string()),
            ("expected.jsonl", EXPECTED.to_string()),
            ("README.md", fill(PY_README)),
            (".gitignore", PY_GITIGNORE.to_string()),
        ]);
    }
    Ok(vec![
        ("Cargo.toml", project_manifest(name)?),
        ("Cargo.lock", PLUGINS_LOCK.to_string()),
        ("src/lib.rs", fill(RUST_LIB)),
        (
            "sdk/Cargo.toml",
            replace_once(SDK_MANIFEST, SDK_WIT_COMMENT, PROJECT_WIT_COMMENT)?,
        ),
        (
            "sdk/src/lib.rs",
            replace_once(SDK_LIB, SDK_WIT_PATH, PROJECT_WIT_PATH)?,
        ),
        ("wit/handler.wit", WIT.to_string()),
        ("events.jsonl", RUST_EVENTS.to_string()),
        ("expected.jsonl", EXPECTED.to_string()),
        ("README.md", fill(RUST_README)),
        (".gitignore", RUST_GITIGNORE.to_string()),
    ])
}

/// Writes the project `dir/name`; refuses a directory that exists and is not empty.
pub fn create(dir: &Path, name: &str, lang: Lang) -> Result<Project, Error> {
    let files = files(name, lang)?;
    let root = dir.join(name);
    match std::fs::read_dir(&root) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(Error::Exists(root));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::Io(root, e)),
    }
    let mut written = Vec::with_capacity(files.len());
    for (rel, contents) in files {
        let path = root.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::Io(parent.to_path_buf(), e))?;
        }
        std::fs::write(&path, contents).map_err(|e| Error::Io(path.clone(), e))?;
        written.push(rel);
    }
    Ok(Project {
        dir: root,
        name: name.to_string(),
        wasm: format!("{}.wasm", name.replace('-', "_")),
        lang,
        files: written,
    })
}

/// `text` with its only occurrence of `from` replaced; a template bug if there is not
/// exactly one (the SDK changed how it finds the WIT).
fn replace_once(text: &str, from: &str, to: &str) -> Result<String, Error> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => Err(Error::Template(format!(
            "expected {from:?} once in the SDK, found it {n} times"
        ))),
    }
}

/// The project's `Cargo.toml`: the handler crate, and a workspace of its own with the SDK
/// as a member and the guest workspace's package fields, dependencies and release profile.
fn project_manifest(name: &str) -> Result<String, Error> {
    let plugins: Table = PLUGINS_MANIFEST
        .parse()
        .map_err(|e| Error::Template(format!("plugins/Cargo.toml: {e}")))?;
    let table = |path: &[&str]| -> Result<Table, Error> {
        let mut t = &plugins;
        for key in path {
            t = t.get(*key).and_then(Value::as_table).ok_or_else(|| {
                Error::Template(format!("plugins/Cargo.toml has no [{}]", path.join(".")))
            })?;
        }
        Ok(t.clone())
    };
    let mut package = table(&["workspace", "package"])?;
    let mut deps = table(&["workspace", "dependencies"])?;
    let profile = table(&["profile", "release"])?;
    // The SDK is in sdk/; the handler is nobody's dependency and is not published.
    let sdk = deps
        .get_mut("dedupd-sdk")
        .and_then(Value::as_table_mut)
        .ok_or_else(|| Error::Template("no dedupd-sdk in [workspace.dependencies]".into()))?;
    sdk.insert("path".into(), Value::String("sdk".into()));
    package.insert("publish".into(), Value::Boolean(false));

    let mut out = String::new();
    out.push_str(&format!(
        "[package]\nname = {}\nversion.workspace = true\nedition.workspace = true\n\
         publish.workspace = true\n\n",
        Value::String(name.into())
    ));
    out.push_str("[lib]\n# A WebAssembly component: build with\n");
    out.push_str("#   cargo build --release --target wasm32-wasip2\n");
    out.push_str("crate-type = [\"cdylib\"]\n\n");
    out.push_str("[dependencies]\n");
    out.push_str("dedupd-sdk = { workspace = true, features = [\"json\"] }\n");
    out.push_str("serde = { workspace = true }\n\n");
    out.push_str(
        "# A workspace of its own, so the project never joins a parent directory's one.\n",
    );
    out.push_str(
        "# sdk/ is the vendored dedupd guest SDK; wit/ holds the contract it is built from.\n",
    );
    out.push_str("[workspace]\nresolver = \"2\"\nmembers = [\"sdk\"]\n\n");
    out.push_str("[workspace.package]\n");
    write_table(&mut out, &package);
    out.push_str("\n[workspace.dependencies]\n");
    write_table(&mut out, &deps);
    out.push_str("\n[profile.release]\n");
    write_table(&mut out, &profile);
    Ok(out)
}

/// `key = value` lines, nested tables inline.
fn write_table(out: &mut String, table: &Table) {
    for (k, v) in table {
        out.push_str(&format!("{} = {}\n", key(k), inline(v)));
    }
}

fn key(k: &str) -> String {
    match k
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        true => k.to_string(),
        false => Value::String(k.into()).to_string(),
    }
}

fn inline(v: &Value) -> String {
    match v {
        Value::Table(t) => {
            let items: Vec<String> = t
                .iter()
                .map(|(k, v)| format!("{} = {}", key(k), inline(v)))
                .collect();
            format!("{{ {} }}", items.join(", "))
        }
        Value::Array(a) => {
            let items: Vec<String> = a.iter().map(inline).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        reason = "tests: a failed unwrap is a failed test"
    )]

    use super::*;

    #[test]
    fn names_are_validated_with_a_reason() {
        for ok in ["demo-handler", "shipping_label", "a", "h2"] {
            validate_name(ok).unwrap();
        }
        for (bad, why) in [
            ("", "empty"),
            ("1st", "start with a letter"),
            ("-x", "start with a letter"),
            ("my handler", "' ' is not allowed"),
            ("café", "is not allowed"),
            ("a/b", "'/' is not allowed"),
            ("fn", "keyword"),
            ("test", "reserves"),
            ("dedupd-sdk", "SDK"),
        ] {
            let e = validate_name(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(e.contains("invalid handler name"), "{e}");
        }
        assert!(validate_name(&"a".repeat(65)).is_err());
    }

    #[test]
    fn rust_and_python_are_offered() {
        assert_eq!("rust".parse::<Lang>().unwrap(), Lang::Rust);
        assert_eq!("python".parse::<Lang>().unwrap(), Lang::Python);
        let e = "go".parse::<Lang>().unwrap_err().to_string();
        assert!(e.contains("choose rust or python"), "{e}");
    }

    #[test]
    fn python_project_vendors_the_sdk_and_pins_componentize_py() {
        let files = files("demo-handler", Lang::Python).unwrap();
        let get = |p: &str| &files.iter().find(|(f, _)| *f == p).unwrap().1;
        assert_eq!(get("dedupd_sdk.py"), PY_SDK);
        assert_eq!(get("wit/handler.wit"), WIT);
        assert!(get("app.py").contains("Handler = dedupd_sdk.export(handle)"));
        let readme = get("README.md");
        assert!(readme.contains("componentize-py==0.25.1"), "{readme}");
        assert!(readme.contains("-o demo_handler.wasm"), "{readme}");
        assert!(!readme.contains("{{") && !get("app.py").contains("{{"));
        // The build script of the repository installs the same version.
        let script = include_str!("../plugins/build-python.sh");
        assert!(
            script.contains(&format!(
                "COMPONENTIZE_PY_VERSION={COMPONENTIZE_PY_VERSION}\n"
            )),
            "plugins/build-python.sh pins another componentize-py"
        );
        let tmp = tempfile::tempdir().unwrap();
        let p = create(tmp.path(), "demo-handler", Lang::Python).unwrap();
        assert_eq!(p.wasm_path(), "demo_handler.wasm");
        assert!(p.dir.join("expected.jsonl").exists());
        assert!(p
            .next_steps()
            .contains("componentize app -o demo_handler.wasm"));
    }

    #[test]
    fn the_sdk_is_vendored_verbatim_but_for_the_wit_path() {
        let files = files("demo-handler", Lang::Rust).unwrap();
        let get = |p: &str| &files.iter().find(|(f, _)| *f == p).unwrap().1;
        let lib = get("sdk/src/lib.rs");
        assert!(lib.contains(r#"path: "../wit","#));
        assert!(!lib.contains("../../wit"));
        assert_eq!(lib.replace(PROJECT_WIT_PATH, SDK_WIT_PATH), SDK_LIB);
        assert_eq!(get("wit/handler.wit"), WIT);
        assert!(get("sdk/Cargo.toml").contains("name = \"dedupd-sdk\""));
        assert!(!get("sdk/Cargo.toml").contains("../../wit"));
        assert!(get("README.md").contains("release/demo_handler.wasm"));
        assert!(!get("README.md").contains("{{"));
        assert!(!get("src/lib.rs").contains("{{"));
        assert_eq!(get(".gitignore").trim(), "/target/");
    }

    #[test]
    fn manifest_is_its_own_workspace_with_the_plugins_versions() {
        let m: Table = project_manifest("demo-handler").unwrap().parse().unwrap();
        assert_eq!(m["package"]["name"].as_str(), Some("demo-handler"));
        assert_eq!(
            m["lib"]["crate-type"].as_array().unwrap(),
            &vec![Value::String("cdylib".into())]
        );
        assert_eq!(m["workspace"]["members"][0].as_str(), Some("sdk"));
        assert_eq!(
            m["workspace"]["dependencies"]["dedupd-sdk"]["path"].as_str(),
            Some("sdk")
        );
        let plugins: Table = PLUGINS_MANIFEST.parse().unwrap();
        for dep in ["wit-bindgen", "serde", "serde_json"] {
            assert_eq!(
                m["workspace"]["dependencies"][dep], plugins["workspace"]["dependencies"][dep],
                "{dep}"
            );
        }
        assert_eq!(m["profile"]["release"], plugins["profile"]["release"]);
        assert_eq!(m["workspace"]["package"]["publish"].as_bool(), Some(false));
    }

    #[test]
    fn create_refuses_a_non_empty_directory_and_fills_an_empty_one() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("empty")).unwrap();
        let p = create(tmp.path(), "empty", Lang::Rust).unwrap();
        assert!(p.dir.join("sdk/src/lib.rs").exists());
        assert_eq!(p.wasm_path(), "target/wasm32-wasip2/release/empty.wasm");
        assert!(p
            .next_steps()
            .contains("cargo build --release --target wasm32-wasip2"));

        std::fs::create_dir(tmp.path().join("full")).unwrap();
        std::fs::write(tmp.path().join("full/keep.txt"), "mine").unwrap();
        let e = create(tmp.path(), "full", Lang::Rust).unwrap_err();
        assert!(matches!(e, Error::Exists(_)), "{e}");
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("full/keep.txt")).unwrap(),
            "mine"
        );
        assert_eq!(
            std::fs::read_dir(tmp.path().join("full")).unwrap().count(),
            1
        );
    }
}
