#!/usr/bin/env bash
# Builds every dedupd handler component in this workspace for wasm32-wasip2 (release).
#
# Usage: plugins/build.sh [extra cargo args, e.g. -p shipping-label or -j 1]
# Works from any directory. Output: plugins/target/wasm32-wasip2/release/<crate_name>.wasm
# (crate name with '-' replaced by '_').
set -euo pipefail

here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
target=wasm32-wasip2

if ! command -v cargo >/dev/null 2>&1; then
    echo "build.sh: cargo not found (install Rust via rustup)" >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    if ! rustup target list --installed | grep -qx "$target"; then
        echo "build.sh: installing Rust target $target" >&2
        rustup target add "$target"
    fi
else
    echo "build.sh: rustup not found; assuming the $target target is installed" >&2
fi

cd "$here"
start=$(date +%s)
# The components must land where the engine looks for them, whatever CARGO_TARGET_DIR says.
cargo build --release --target "$target" --target-dir "$here/target" "$@"
echo "build.sh: built in $(( $(date +%s) - start ))s; components:"

out="$here/target/$target/release"
# Every cdylib crate of the workspace (examples/* and fixtures/*; the SDK is an rlib).
for manifest in "$here"/examples/*/Cargo.toml "$here"/fixtures/*/Cargo.toml; do
    name=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$manifest" | head -n 1)
    f="$out/${name//-/_}.wasm"
    if [ -f "$f" ]; then
        printf '  %-72s %8d bytes\n' "$f" "$(wc -c <"$f")"
    fi
done
