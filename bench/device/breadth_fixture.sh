#!/usr/bin/env bash
# Parallel-breadth fixture, the part one GPU can run: a profiled single-GPU FSDP2 run of the small preset with
# gradient accumulation (4 micro-batches per optimizer step), so the trace holds the `microbatch[<i>]` ranges and
# one gradient sync per optimizer step. Pipeline parallel and HSDP need several GPUs (bench/multi_gpu.py).
# On one GPU (kind nvidia-h200), from the repo root:
#   bash bench/device/breadth_fixture.sh "$OUT"
# Writes to $OUT: breadth-run.log, rank0.jsonl, window000/rank0.*.pt.trace.json.gz. Budget: a timeout of 200 s.
set -u
source bench/device/setup.sh
out="$1"
run=/tmp/breadth-run
rm -rf "$run"
timeout 200 python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 -m fleetscope.trainer \
  --run-dir "$run" --device cuda --model qwen3_moe --preset small --parallel fsdp --batch-size 4 --seq-len 2048 \
  --compile none --steps 8 --profile skip_first=5,wait=1,warmup=1,active=1 --set optim.accumulation_steps=4 \
  > "$out/breadth-run.log" 2>&1
echo "trainer exit status: $?" | tee -a "$out/breadth-run.log"
grep -E "step (0|5|7) |published|Error|error" "$out/breadth-run.log" | tail -10
mkdir -p "$out/window000"
cp "$run"/metrics/rank0.jsonl "$out/" 2>/dev/null
cp "$run"/traces/window000/*.pt.trace.json.gz "$out/window000/" 2>/dev/null
python3 - "$out" <<'PY'
import collections, glob, gzip, json, sys
from fleetscope.traces.formats import parse_microbatch_range
for path in glob.glob(f"{sys.argv[1]}/window000/*.pt.trace.json.gz"):
    names = collections.Counter(e.get("name") for e in json.load(gzip.open(path))["traceEvents"]
                                if parse_microbatch_range(str(e.get("name", ""))) is not None)
    print("microbatch ranges:", dict(sorted(names.items())))
PY
ls -la "$out" "$out/window000"
exit 0
