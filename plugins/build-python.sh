#!/usr/bin/env bash
# Builds Python handler components with componentize-py (pinned below), against the
# dedupd WIT contract and the Python SDK (sdk-python/dedupd_sdk.py).
#
# Usage: plugins/build-python.sh [APP_DIR [OUT.wasm]]
#   APP_DIR  a directory holding app.py (default: every examples/python-* and
#            fixtures/python-*)
#   OUT      the component (default: target/wasm32-wasip2/release/<dir name, '-' as '_'>.wasm
#            in plugins/, next to the Rust components)
# Works from any directory. componentize-py is installed into a virtualenv under
# plugins/target/ on first use (needs python3 with venv; Debian: python3 python3-venv).
# A component newer than its app, the SDK and the WIT is not rebuilt.
set -euo pipefail

COMPONENTIZE_PY_VERSION=0.25.1
here="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
wit="$here/../wit"
venv="$here/target/python-venv"
out_dir="$here/target/wasm32-wasip2/release"

tool="$venv/bin/componentize-py"
if ! "$tool" --version 2>/dev/null | grep -qx "componentize-py $COMPONENTIZE_PY_VERSION"; then
    if ! command -v python3 >/dev/null 2>&1; then
        echo "build-python.sh: python3 not found (Debian: apt-get install python3 python3-venv)" >&2
        exit 1
    fi
    echo "build-python.sh: installing componentize-py $COMPONENTIZE_PY_VERSION into $venv" >&2
    python3 -m venv "$venv" || {
        echo "build-python.sh: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
        exit 1
    }
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "componentize-py==$COMPONENTIZE_PY_VERSION"
fi

build() {
    local app_dir out
    app_dir="$(cd -- "$1" && pwd)"
    out="${2:-$out_dir/$(basename "$app_dir" | tr - _).wasm}"
    if [ ! -f "$app_dir/app.py" ]; then
        echo "build-python.sh: $app_dir has no app.py" >&2
        exit 1
    fi
    if [ -f "$out" ] && [ -z "$(find "$app_dir" "$here/sdk-python" "$wit" -name '*.py' -newer "$out" -o -name '*.wit' -newer "$out")" ]; then
        echo "build-python.sh: $out is up to date"
        return
    fi
    mkdir -p "$(dirname "$out")"
    local start
    start=$(date +%s)
    echo "build-python.sh: building $app_dir (componentize-py, about 25 s)"
    "$tool" -d "$wit" -w dedupd-handler componentize \
        -p "$app_dir" -p "$here/sdk-python" app -o "$out"
    printf 'build-python.sh: built in %ss: %s (%d bytes)\n' \
        "$(( $(date +%s) - start ))" "$out" "$(wc -c <"$out")"
}

if [ $# -gt 0 ]; then
    build "$@"
else
    for app in "$here"/examples/python-*/ "$here"/fixtures/python-*/; do
        build "$app"
    done
fi
