#!/usr/bin/env bash
# On a lent GPU: record the ground-truth corpus (bench/planted/corpus.py) and all three held-out sets
# (heldout.py, heldout2.py, heldout3.py) in one call, to score the advisor blind on new recordings; bring them back
# through $OUT as one tarball per set, with the logs and the GPU's name. Usage: bash bench/device/blind.sh "$OUT"
set -uo pipefail
out="${1:?usage: blind.sh OUT}"
source bench/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$out/gpu.txt" 2>&1
rm -rf /tmp/blind && mkdir -p /tmp/blind
python3 bench/planted/corpus.py /tmp/blind/corpus 2>&1 | tee "$out/blind.log"
for set in heldout heldout2 heldout3; do
    python3 "bench/planted/$set.py" "/tmp/blind/$set" 2>&1 | tee -a "$out/blind.log"
done
for set in corpus heldout heldout2 heldout3; do
    # the compile caches are not traces: leave them behind
    tar -cf "$out/$set.tar" --exclude=.compile_cache --exclude=tmp -C /tmp/blind "$set"
done
ls -la "$out"
