#!/usr/bin/env bash
# On a lent GPU: record the third held-out set (bench/planted/heldout3.py) and bring it back through $OUT as one
# tarball, with the log and the GPU's name. Usage: bash bench/device/heldout3.sh "$OUT" [NAME ...] (default: all)
set -uo pipefail
out="${1:?usage: heldout3.sh OUT [NAME ...]}"
shift
source bench/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$out/gpu.txt" 2>&1
rm -rf /tmp/h3 && mkdir -p /tmp/h3
python3 bench/planted/heldout3.py /tmp/h3 "$@" 2>&1 | tee "$out/heldout3.log"
tar -cf "$out/heldout3.tar" -C /tmp h3
ls -la "$out"
