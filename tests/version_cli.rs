//! What the binary says about itself: its version with the commit and the formats it
//! reads, shell completions and the manual page, all from the one command tree.
#![allow(
    clippy::unwrap_used,
    reason = "helpers outside #[test]: a failed unwrap is a failed test"
)]

mod common;

use common::dedupd;

#[test]
fn version_names_the_commit_and_the_formats_it_reads() {
    let long = dedupd(&["--version"]);
    long.assert_success();
    let first = long.stdout.lines().next().unwrap();
    let commit = first
        .split("(commit ")
        .nth(1)
        .and_then(|c| c.strip_suffix(')'))
        .unwrap_or_else(|| panic!("no commit in {first:?}"));
    // From a git checkout the build knows its commit; from a source tarball it says so.
    let checkout = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".git")
        .exists();
    if checkout {
        assert!(
            commit.len() == 12 && commit.chars().all(|c| c.is_ascii_hexdigit()),
            "{first:?}"
        );
    } else {
        assert_eq!(commit, "unknown", "{first:?}");
    }
    let data_format = format!("data format {}", dedupd::ledger::FORMAT_VERSION);
    assert!(long.stdout.contains(&data_format), "{}", long.stdout);
    assert!(long.stdout.contains("backup format"), "{}", long.stdout);
    let command = dedupd(&["version"]);
    command.assert_success();
    assert_eq!(command.stdout, long.stdout);
    let short = dedupd(&["-V"]);
    short.assert_success();
    assert!(short.stdout.contains(commit), "{}", short.stdout);
}

#[test]
fn completions_cover_every_command_and_unknown_shells_are_refused() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let run = dedupd(&["completions", shell]);
        run.assert_success();
        for word in ["pipe", "inspect", "data-dir", "completions"] {
            assert!(run.stdout.contains(word), "{shell}: no {word}");
        }
    }
    let refused = dedupd(&["completions", "tcsh"]);
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(refused.stderr.contains("bash"), "{}", refused.stderr);
}

#[test]
fn man_page_is_roff_with_the_commands() {
    let run = dedupd(&["man"]);
    run.assert_success();
    assert!(run.stdout.contains(".TH dedupd"), "{}", &run.stdout[..200]);
    for command in ["pipe", "run", "serve", "inspect", "backup", "restore"] {
        assert!(run.stdout.contains(command), "no {command}");
    }
}
