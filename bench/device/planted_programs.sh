#!/usr/bin/env bash
# Ground truth for programs nobody here wrote, profiled on one H200 (kind nvidia-h200). From the repo root:
#   bash bench/device/planted_programs.sh "$OUT" [NAME ...]
# bench/planted/programs.py's small PyTorch programs (one planted problem each; NAME picks some), then
# bench/planted/pairs.py's two-rank straggler cases (slow_device, more_tokens; gloo, both ranks on the one GPU).
# Writes $OUT/planted.tar.gz (one folder per program: its gzipped Kineto traces and planted.json) and
# $OUT/planted.log. Budget: ~3 min.
set -u
out="$1"; shift
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
timeout 300 python3 bench/planted/programs.py /tmp/planted "$@" 2>&1 | grep -v "^STAGE:" | tail -40 | tee "$out/planted.log"
for case in slow_device more_tokens; do
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/planted/pairs.py /tmp/planted "$case" \
    2>&1 | grep -v "^STAGE:" | tail -15 | tee -a "$out/planted.log"
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/planted.log" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$out/planted.log" 2>&1
tar -C /tmp -czf "$out/planted.tar.gz" planted
ls -la /tmp/planted/* >> "$out/planted.log"
exit 0
