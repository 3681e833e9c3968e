#!/usr/bin/env bash
# The trainer's modes on one GPU with bf16 and compilation, with the features that need CUDA:
# FSDP2 mixed precision and CPU offload, a memory snapshot, checkpoint + resume.
# Usage: bash bench/device/trainer_modes.sh RUNS_DIR
set -u
runs="$1"
launch() { timeout 200 python3 -m fleetscope.cli.main launch --no-post --nproc-per-node 1 --device cuda \
  --preset small --batch-size 8 --seq-len 2048 "$@" 2>&1 | grep -E "step (0|9|19) |Error|error|FAILED|checkpoint|resumed|snapshot"; }
profile="skip_first=10,wait=2,warmup=2,active=2"
launch --run-dir "$runs/ddp-compile" --parallel ddp --compile default --steps 20 --profile "$profile"
launch --run-dir "$runs/fsdp-compile" --parallel fsdp --compile default --steps 20 --profile "$profile"
launch --run-dir "$runs/fsdp-cpu-offload" --parallel fsdp --set parallel.cpu_offload=true --steps 10 --profile off
launch --run-dir "$runs/ddp-memory-snapshot" --parallel ddp --steps 6 --profile off \
  --set observability.memory_snapshot_step=4
launch --run-dir "$runs/fsdp-checkpoint" --parallel fsdp --steps 10 --profile off --set checkpoint.every=5
launch --run-dir "$runs/fsdp-checkpoint" --parallel fsdp --steps 15 --profile off --set checkpoint.every=5 --resume
ls -la "$runs"/*/memory 2>/dev/null
exit 0
