#!/usr/bin/env bash
# A job that joins an external coordinator, as it would one started from the container image:
#   docker run -p 29500:29500 -e AIOCOLL_TOKEN=secret aiocoll   (see docs/CONTAINER.md)
# Here the coordinator runs as the image's default command does, on loopback, so the example is
# runnable without a container engine. Usage: examples/external_coordinator.sh [NPROC]
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=${1:-2}
export AIOCOLL_TOKEN=${AIOCOLL_TOKEN:-example-secret}
log=$(mktemp)
aiocoll coordinator --host 127.0.0.1 --port 0 >"$log" 2>&1 &
coordinator=$!
trap 'kill $coordinator 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 100); do
  address=$(grep -oE 'listening on [0-9.]+:[0-9]+' "$log" | head -1 | cut -d' ' -f3) && [ -n "$address" ] && break
  sleep 0.1
done
[ -n "${address:-}" ] || { echo "coordinator did not start:"; cat "$log"; exit 1; }
echo "coordinator at $address"
aiocoll run --nproc-per-node "$nproc" --coordinator "$address" --job external-demo examples/demo.py
aiocoll status --coordinator "$address"
