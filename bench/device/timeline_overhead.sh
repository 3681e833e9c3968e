#!/usr/bin/env bash
# What the whole-run parts (the per-step timeline record and the triggers' change detectors) cost on one H200
# (kind nvidia-h200): bench/timeline_gpu_overhead.py, small preset, batch 4 x 128, eager then CUDA graphs, each one
# process whose blocks of 10 steps alternate the parts on and off. From the repo root:
#   bash bench/device/timeline_overhead.sh "$OUT" [STEPS]
# Writes $OUT/timeline-overhead-{none,reduce-overhead}.json and .log. Budget: ~1 min eager, ~4 min with graphs
# (one cold compile).
set -u
source bench/device/setup.sh
out="$1"; steps="${2:-400}"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"
for mode in none reduce-overhead; do
  timeout 280 python3 bench/timeline_gpu_overhead.py --out "/tmp/tlo-$mode" --compile "$mode" --steps "$steps" \
    2>&1 | tee "$out/timeline-overhead-$mode.log"
  cp "/tmp/tlo-$mode/timeline-overhead.json" "$out/timeline-overhead-$mode.json" 2>/dev/null
done
exit 0
