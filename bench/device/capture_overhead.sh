#!/usr/bin/env bash
# The always-on capture parts on one H200 (kind nvidia-h200): request polling, anomaly triggers riding on the
# stop-flag all-reduce, the Flight Recorder (TORCH_FR_BUFFER_SIZE=2000) and the hang watchdog, on vs
# off, ABBA order, the small preset compiled; target: <= 0.5% step time. From the repo root:
#   bash bench/device/capture_overhead.sh "$OUT"
# Writes $OUT/capture-overhead.json and $OUT/capture-overhead.log. Budget: ~6 min (4 runs of 70 steps, compile
# ~1 min each; --repeats 1 for ~3 min).
set -u
source bench/device/setup.sh
out="$1"
timeout 560 python3 bench/capture_overhead.py --out /tmp/capture-overhead --device cuda --nproc 1 --preset small \
  --batch 8 --seq 2048 --steps 70 --skip 20 --repeats 2 --sequential --set performance.compile=default \
  2>&1 | tail -20 | tee "$out/capture-overhead.log"
cp /tmp/capture-overhead/capture-overhead.json "$out/" 2>/dev/null
exit 0
