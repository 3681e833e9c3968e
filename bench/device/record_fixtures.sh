#!/usr/bin/env bash
# Real GPU traces for the test fixtures: the tiny MoE profiled on the GPU.
#   fsdp-1rank:  one rank, FSDP2 over NCCL (collectives with one member)
#   ddp-gloo-2rank: two ranks sharing the GPU, DDP over gloo (CUDA kernels + gloo comm)
#   ddp-nccl-2rank: two ranks on one GPU over NCCL (NCCL may refuse: recorded either way)
# Usage: bash bench/device/record_fixtures.sh RUNS_DIR
set -u
runs="$1"
launch() { timeout 240 python3 -m fleetscope.cli.main launch --no-post --device cuda --model qwen3_moe \
  --preset tiny --steps 8 --profile wait=2,warmup=2,active=2 --set profiler.record_shapes=true "$@"; }
launch --run-dir "$runs/gpu-fsdp-1rank" --nproc-per-node 1 --parallel fsdp
launch --run-dir "$runs/gpu-ddp-gloo-2rank" --nproc-per-node 2 --parallel ddp --set parallel.backend=gloo
launch --run-dir "$runs/gpu-ddp-nccl-2rank" --nproc-per-node 2 --parallel ddp 2>&1 | tail -30
exit 0
