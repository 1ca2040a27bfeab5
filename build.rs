//! Records the commit the binary is built from (`dedupd --version`, `dedupd_build_info`):
//! `git rev-parse` when the source is a git checkout, `unknown` otherwise (a crate
//! tarball).

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

fn main() {
    let revision = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=DEDUPD_REVISION={revision}");
    println!("cargo:rerun-if-changed=build.rs");
    // Built again when HEAD moves: HEAD itself, the branch it names and the packed refs.
    // Only files that exist: a missing one would make every build run this again.
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(branch);
    }
    for name in watch {
        if let Some(path) = git(&["rev-parse", "--git-path", &name]).map(PathBuf::from) {
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
}
