#!/usr/bin/env bash
# Profiler and capture-part overhead on one H200 (kind nvidia-h200): bench/profiler_overhead.py's four arms
# (capture off, never profiled, profiled with CUPTI left subscribed, profiled with the default teardown), ABAB,
# 3 rounds, small preset, batch 4 x 128, 90 steps, three windows (repeat=3). From the repo root:
#   bash bench/device/profiler_overhead.sh "$OUT" MODE [SECONDS]
# MODE: none (eager) or reduce-overhead (CUDA graphs; also the check that teardown with graphs and 3 windows does
# not crash). Writes $OUT/profiler-overhead-MODE.json and .log. Budget: eager ~4 min, reduce-overhead ~8 min
# (one cold compile, then the shared inductor cache).
set -u
source bench/device/setup.sh
out="$1"; mode="$2"; seconds="${3:-540}"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device-$mode.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device-$mode.txt"
timeout "$seconds" python3 bench/profiler_overhead.py --out "/tmp/po-$mode" --compile "$mode" --repeats 3 \
  2>&1 | tee "$out/profiler-overhead-$mode.log"
cp "/tmp/po-$mode/profiler-overhead.json" "$out/profiler-overhead-$mode.json" 2>/dev/null
exit 0
