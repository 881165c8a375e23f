#!/usr/bin/env bash
# Run compose.yaml's swarm until every stage has exited for good, showing stage 0's log, then stop
# the DHT node.   docker/compose-demo.sh [COMPOSE COMMAND...]   (default: docker compose)
# The volumes stay: run it again to continue a stopped run (peers start with --auto-resume);
# `docker compose down -v` removes the run, its key and the DHT identity.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then COMPOSE=("$@"); else COMPOSE=(docker compose); fi
started=$(date +%s)
"${COMPOSE[@]}" up -d
"${COMPOSE[@]}" logs -f --no-log-prefix stage0 &
logs=$!
trap 'kill $logs 2>/dev/null || true' EXIT
ids=$("${COMPOSE[@]}" ps -q stage0 stage1 stage2 stage3)
# A crashed stage restarts (its restart policy) and rejoins: wait until none runs or restarts.
while docker inspect -f '{{.State.Status}}' $ids | grep -qv exited; do sleep 5; done
kill $logs 2>/dev/null || true
"${COMPOSE[@]}" stop dht >/dev/null 2>&1
codes=$(docker inspect -f '{{.State.ExitCode}}' $ids | tr '\n' ' ')
echo "compose demo: stages exited with $codes after $(( $(date +%s) - started )) s; metrics and" \
     "checkpoints are in the shared volume's run/ folder"
for code in $codes; do [ "$code" = 0 ] || exit 1; done
