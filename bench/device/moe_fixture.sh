#!/usr/bin/env bash
# MoE fixture: one short profiled single-GPU run of the small preset (qwen3_moe, 16 experts top-2, 8 MoE
# layers) in eager mode with the hot-expert fault on expert 3, so the trace holds every layer's
# `moe/router|dispatch|experts|combine[layer L]` ranges (record_function + NVTX) and metrics/rank0.moe.jsonl
# holds per-(step, layer) tokens per expert with expert 3 the hottest. Eager, because Dynamo may drop
# record_function ranges inside compiled blocks.
# On one GPU (kind nvidia-h200), from the repo root:
#   bash bench/device/moe_fixture.sh "$OUT"
# Writes to $OUT: moe-run.log, rank0.jsonl, rank0.moe.jsonl, window000/rank0.*.pt.trace.json.gz,
# moe-ranges.txt (range names and counts found in the trace) and moe-fixture.tgz (all of them).
# Budget: a timeout of 180 s on the run (12 steps, eager).
set -u
source bench/device/setup.sh
out="$1"
run=/tmp/moe-run
rm -rf "$run"
timeout 180 python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 -m fleetscope.trainer \
  --run-dir "$run" --device cuda --model qwen3_moe --preset small --batch-size 8 --seq-len 2048 --compile none \
  --steps 12 --profile skip_first=8,wait=1,warmup=1,active=2 \
  --set faults.hot_expert=3 --set faults.hot_expert_bias=4.0 --set observability.moe_records=true \
  > "$out/moe-run.log" 2>&1
echo "trainer exit status: $?" | tee -a "$out/moe-run.log"
grep -E "step (0|8|11) |published|Error|error" "$out/moe-run.log" | tail -20
mkdir -p "$out/window000"
cp "$run"/metrics/rank0.jsonl "$run"/metrics/rank0.moe.jsonl "$out/" 2>/dev/null
cp "$run"/traces/window000/*.pt.trace.json.gz "$out/window000/" 2>/dev/null
python3 - "$out" <<'PY' > "$out/moe-ranges.txt" 2>&1
import collections, glob, gzip, json, sys
from fleetscope.traces.formats import parse_moe_range, read_moe_records
counts = collections.Counter()
for path in glob.glob(f"{sys.argv[1]}/window000/*.pt.trace.json.gz"):
    for event in json.load(gzip.open(path))["traceEvents"]:
        parsed = parse_moe_range(event.get("name", ""))
        if parsed:
            counts[(event.get("cat"), *parsed)] += 1
for key, n in sorted(counts.items(), key=str):
    print(*key, n)
records = read_moe_records(f"{sys.argv[1]}/rank0.moe.jsonl")
hot = sum(r.tokens_per_expert.index(max(r.tokens_per_expert)) == 3 for r in records)
print(f"records: {len(records)}; expert 3 hottest in {hot}")
PY
cat "$out/moe-ranges.txt" | tail -30
tar czf "$out/moe-fixture.tgz" -C "$run" --exclude=checkpoints --exclude=logs metrics traces 2>/dev/null
ls -la "$out" "$out/window000"
exit 0
