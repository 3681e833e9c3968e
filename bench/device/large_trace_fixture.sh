#!/usr/bin/env bash
# A large real trace for the post-processing benchmarks (bench/postprocess_scale.py, bench/analysis_scale.py):
# one rank of the medium preset, eager, batch 8 x 2048, record_shapes and with_stack on, three active steps (2 gave 32 MB; the benchmarks want >= 40 MB).
# On one GPU (kind nvidia-h200), from the repo root:
#   bash bench/device/large_trace_fixture.sh "$OUT"
# Writes to $OUT: large-trace-run.log, rank0.jsonl and large-trace.json.gz (the window's trace, recompressed
# at level 9 for the repository). Budget: a timeout of 300 s on the run.
set -u
source bench/device/setup.sh
out="$1"
run=/tmp/large-trace-run
rm -rf "$run"
timeout 300 python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 -m fleetscope.trainer \
  --run-dir "$run" --device cuda --preset medium --batch-size 8 --seq-len 2048 --compile none --steps 10 \
  --profile skip_first=4,wait=1,warmup=1,active=3 \
  --set profiler.record_shapes=true --set profiler.with_stack=true \
  > "$out/large-trace-run.log" 2>&1
echo "trainer exit status: $?" | tee -a "$out/large-trace-run.log"
grep -E "step [0-9]+ |published|Error|error" "$out/large-trace-run.log" | tail -12
cp "$run"/metrics/rank0.jsonl "$out/" 2>/dev/null
trace=$(ls "$run"/traces/window000/*.pt.trace.json* 2>/dev/null | head -1)
if [ -n "$trace" ]; then
  case "$trace" in *.gz) zcat "$trace" ;; *) cat "$trace" ;; esac > /tmp/large-trace.json
  ls -la /tmp/large-trace.json | tee -a "$out/large-trace-run.log"
  gzip -9 -c /tmp/large-trace.json > "$out/large-trace.json.gz"
fi
ls -la "$out"
exit 0
