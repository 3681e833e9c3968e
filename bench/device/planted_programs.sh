#!/usr/bin/env bash
# Ground truth for programs nobody here wrote: bench/planted/programs.py's six small PyTorch programs, each with
# one planted problem, profiled on one H200 (kind nvidia-h200). From the repo root:
#   bash bench/device/planted_programs.sh "$OUT"
# Writes $OUT/planted.tar.gz (one folder per program: its gzipped Kineto trace and planted.json) and
# $OUT/planted.log. Budget: ~2 min.
set -u
out="$1"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
timeout 400 python3 bench/planted/programs.py /tmp/planted 2>&1 | grep -v "^STAGE:" | tail -40 | tee "$out/planted.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$out/planted.log" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$out/planted.log" 2>&1
tar -C /tmp -czf "$out/planted.tar.gz" planted
ls -la /tmp/planted/* >> "$out/planted.log"
exit 0
