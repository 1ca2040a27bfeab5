#!/usr/bin/env bash
# HTTP ingest benchmark: keep-alive HTTP/1.1, 256 connections, 10% retries of earlier keys,
# against `dedupd serve` (release build) on a fresh data directory, with a trivial 200
# route (/healthz) of the same server measured in the same run as the baseline.
#
# Usage: scripts/http-bench.sh [runs=3] [seconds=15] [connections=256]
# Needs `wrk` (Debian package wrk) and a release build (cargo build --release).
# Prints each run and the medians.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=${1:-3}
secs=${2:-15}
conns=${3:-256}
threads=${WRK_THREADS:-2}
bin=target/release/dedupd
command -v wrk >/dev/null || { echo "http-bench: wrk is not installed (apt-get install wrk)" >&2; exit 1; }
[ -x "$bin" ] || { echo "http-bench: $bin is missing: cargo build --release" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/dedupd-http-bench.XXXXXX")
port=$(( 20000 + RANDOM % 20000 ))
cat > "$work/bench.toml" <<TOML
[http]
bind = "127.0.0.1:$port"
max_concurrency = 4096
TOML
"$bin" serve --config "$work/bench.toml" --data-dir "$work/data" 2> "$work/server.log" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 1 100); do
  curl -sf "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done

# wrk's summary -> "req/s p99_ms non2xx"
summarize() {
  awk '
    /Requests\/sec/ { rps = $2 }
    /^ +99%/ { v = $2; if (v ~ /us$/) { sub(/us/, "", v); v = v / 1000 } else if (v ~ /ms$/) { sub(/ms/, "", v) } else if (v ~ /s$/) { sub(/s/, "", v); v = v * 1000 }; p99 = v }
    /Non-2xx/ { bad = $NF }
    END { printf "%.0f %.2f %d\n", rps, p99, bad + 0 }'
}

echo "http-bench: $runs runs x ${secs}s, $conns connections, $threads wrk thread(s), 10% retries; server pid $server on port $port"
ingest_rps=(); ingest_p99=(); base_rps=(); base_p99=()
for r in $(seq 1 "$runs"); do
  base=$(wrk -t"$threads" -c"$conns" -d"${secs}s" --latency "http://127.0.0.1:$port/healthz" | summarize)
  ingest=$(wrk -t"$threads" -c"$conns" -d"${secs}s" --latency -s scripts/http-bench.lua "http://127.0.0.1:$port" -- 0.1 "r$r" | summarize)
  read -r b_rps b_p99 b_bad <<< "$base"
  read -r i_rps i_p99 i_bad <<< "$ingest"
  echo "run $r: ingest $i_rps req/s p99 $i_p99 ms (non-2xx $i_bad) | /healthz $b_rps req/s p99 $b_p99 ms | ratio $(awk -v a="$i_rps" -v b="$b_rps" 'BEGIN{printf "%.2f", a/b}')"
  ingest_rps+=("$i_rps"); ingest_p99+=("$i_p99"); base_rps+=("$b_rps"); base_p99+=("$b_p99")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mi=$(median "${ingest_rps[@]}"); mp=$(median "${ingest_p99[@]}")
bi=$(median "${base_rps[@]}"); bp=$(median "${base_p99[@]}")
echo "median: ingest $mi req/s, p99 $mp ms; /healthz $bi req/s, p99 $bp ms; ingest/trivial = $(awk -v a="$mi" -v b="$bi" 'BEGIN{printf "%.2f", a/b}')"
curl -s "http://127.0.0.1:$port/v1/subscribers/bench/stats"; echo
