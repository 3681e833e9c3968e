#!/usr/bin/env bash
# Evidence fixture: one short profiled single-GPU run of the small preset, compiled (Inductor), with
# record_shapes, profile_memory and with_stack on, no injected faults (leak and graph break off). Gives the
# analysis a real CUDA trace plus the per-step memory / communication fields and the compile record.
# On one GPU (kind nvidia-h200), from the repo root:
#   bash bench/device/evidence_fixture.sh "$OUT"
# Writes to $OUT: evidence-run.log, rank0.jsonl, rank0.compile.json, window000/rank0.*.pt.trace.json.gz
# and evidence-fixture.tgz (all of them). Budget: a timeout of 220 s on the run (compile ~1 min, 12 steps).
set -u
source bench/device/setup.sh
out="$1"
run=/tmp/evidence-run
rm -rf "$run"
timeout 220 python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 -m fleetscope.trainer \
  --run-dir "$run" --device cuda --preset small --batch-size 8 --seq-len 2048 --compile default --steps 12 \
  --profile skip_first=8,wait=1,warmup=1,active=2 \
  --set profiler.record_shapes=true --set profiler.profile_memory=true --set profiler.with_stack=true \
  --set observability.mllog=true --set faults.leak_mb_per_step=0 --set faults.graph_break=false \
  > "$out/evidence-run.log" 2>&1
echo "trainer exit status: $?" | tee -a "$out/evidence-run.log"
grep -E "step (0|8|11) |compile record|published|Error|error" "$out/evidence-run.log" | tail -20
mkdir -p "$out/window000"
cp "$run"/metrics/rank0.jsonl "$run"/metrics/rank0.compile.json "$out/" 2>/dev/null
cp "$run"/traces/window000/*.pt.trace.json.gz "$out/window000/" 2>/dev/null
tar czf "$out/evidence-fixture.tgz" -C "$run" --exclude=checkpoints --exclude=logs metrics traces 2>/dev/null
ls -la "$out" "$out/window000"
exit 0
