#!/usr/bin/env bash
# What the whole-run parts (the per-step timeline record and the triggers' change detectors) cost on one H200
# (kind nvidia-h200): bench/timeline_gpu_overhead.py's two arms, ABAB, small preset, batch 4 x 128, 150 steps.
# From the repo root:
#   bash bench/device/timeline_overhead.sh "$OUT" MODE [ROUNDS] [SECONDS]
# MODE: none (eager) or reduce-overhead (CUDA graphs). Writes $OUT/timeline-overhead-MODE.json and .log.
# Budget: ~45 s a launch (start-up dominates), two launches a round; reduce-overhead adds one cold compile.
set -u
source bench/device/setup.sh
out="$1"; mode="$2"; rounds="${3:-5}"; seconds="${4:-560}"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device-$mode.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device-$mode.txt"
timeout "$seconds" python3 bench/timeline_gpu_overhead.py --out "/tmp/tlo-$mode" --compile "$mode" --repeats "$rounds" \
  2>&1 | tee "$out/timeline-overhead-$mode.log"
cp "/tmp/tlo-$mode/timeline-overhead.json" "$out/timeline-overhead-$mode.json" 2>/dev/null
exit 0
