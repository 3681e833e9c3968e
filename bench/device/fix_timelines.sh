#!/usr/bin/env bash
# On a lent GPU: record held-out programs as written and with each planted cause alone fixed, timed in
# alternating rounds (bench/planted/fix_timelines.py), and bring the traces back as one tarball with the log.
# Usage: bash bench/device/fix_timelines.sh OUT SET NAME [NAME ...]
set -uo pipefail
out="${1:?usage: fix_timelines.sh OUT SET NAME...}"
set_name="${2:?usage: fix_timelines.sh OUT SET NAME...}"
shift 2
source bench/device/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$out/gpu.txt" 2>&1
rm -rf /tmp/fix_timelines && mkdir -p /tmp/fix_timelines
(cd bench/planted && python3 fix_timelines.py "$set_name" /tmp/fix_timelines "$@") 2>&1 | tee "$out/fix_timelines.log"
tar -cf "$out/fix_timelines.tar" --exclude=.compile_cache --exclude=tmp -C /tmp fix_timelines
ls -la "$out"
