#!/usr/bin/env bash
# On a lent GPU: record the ground-truth corpus (bench/planted/corpus.py) and the held-out sets (heldout.py ...
# heldout4.py) in one call, to score the advisor blind on new recordings; bring them back through $OUT as one
# tarball per set, with the log and the GPU's name (a call returns at most eight files: seven here).
# Usage: bash bench/device/blind.sh "$OUT" [SET ...]   (SET: corpus heldout heldout2 ... heldout10;
#   default: corpus to heldout4)
set -uo pipefail
out="${1:?usage: blind.sh OUT [SET ...]}"
shift
sets=("$@")
[ ${#sets[@]} -eq 0 ] && sets=(corpus heldout heldout2 heldout3 heldout4)
source bench/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$out/gpu.txt" 2>&1
rm -rf /tmp/blind && mkdir -p /tmp/blind
for set in "${sets[@]}"; do
    case "$set" in corpus|heldout|heldout[2-9]|heldout10) ;; *) echo "unknown set: $set" >&2; exit 2 ;; esac
    python3 "bench/planted/$set.py" "/tmp/blind/$set" 2>&1 | tee -a "$out/blind.log"
    # the compile caches are not traces: leave them behind
    tar -cf "$out/$set.tar" --exclude=.compile_cache --exclude=tmp -C /tmp/blind "$set"
done
ls -la "$out"
