#!/usr/bin/env bash
# Issue: real multi-GPU runs on NCCL. On a machine of N GPUs (kinds nvidia-h200-x2/-x4/-x8), from the repo root:
#   bash bench/device/multi_gpu.sh "$OUT"
# then here: tar xzf OUT/multi-gpu-runs.tgz -C RUNS && python bench/multi_gpu.py summarize RUNS
set -u
source bench/device/setup.sh
out="$1"
gpus=$(nvidia-smi -L | wc -l)
python3 bench/multi_gpu.py run --out /tmp/multi-gpu --nproc "$gpus" 2>&1 | tail -40 | tee "$out/multi-gpu-run.log"
tar czf "$out/multi-gpu-runs.tgz" --exclude=checkpoints --exclude=logs -C /tmp/multi-gpu .
