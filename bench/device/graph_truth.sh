#!/usr/bin/env bash
# On a lent GPU: every planted set recorded blind (blind.sh) and, on the same host, what one CUDA graph replaying
# the step saves on the healthy and launch-bound programs (graph_truth.py): the truth cuda_graphs' gain is judged
# against. Usage: bash bench/device/graph_truth.sh "$OUT"
set -uo pipefail
out="${1:?usage: graph_truth.sh OUT}"
bash bench/device/blind.sh "$out"
source bench/device/setup.sh
python3 bench/device/graph_truth.py "$out/graph_truth.json" healthy_sdpa_bf16 healthy_bf16_mlp \
    healthy_conv_channels_last launch_bound_tiny_layers tiny_batch_mlp 2>&1 | tee "$out/graph_truth.log"
