#!/usr/bin/env bash
# On a lent GPU: corpus programs recorded as written and fixed (bench/planted/diff_pairs.py), for
# `fleetscope diff`; brought back through $OUT as one tarball. Usage: bash bench/device/diff_pairs.sh "$OUT"
set -uo pipefail
out="${1:?usage: diff_pairs.sh OUT}"
source bench/device/setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
rm -rf /tmp/pairs && mkdir -p /tmp/pairs
python3 bench/planted/diff_pairs.py /tmp/pairs precision_fp32_mlp eager_attention_causal optimizer_impl_foreach_mlp \
    allocator_churn_mlp pageable_copy_batch host_syncs_item_per_layer 2>&1 | grep -v USDT | tee "$out/pairs.log"
tar -cf "$out/pairs.tar" -C /tmp pairs
ls -la "$out"
