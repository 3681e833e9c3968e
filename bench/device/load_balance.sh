#!/usr/bin/env bash
# The routers' load-balancing loss on one GPU (kind nvidia-h200): the small preset (qwen3_moe, 16 experts
# top-2, 8 MoE layers), bf16, compiled per block (performance.compile=default, Inductor), with a skewed router
# (faults.expert_skew=1), off vs model.router_aux_loss_coef=0.01, same seed. Prints per run the step-0 and last
# loss, the median step time of the last 10 steps and, per step, the coefficient of variation of the tokens per
# expert (std / mean, mean over layers). From the repo root:
#   bash bench/device/load_balance.sh "$OUT"
# Writes $OUT/load-balance.log. Budget: ~5 min (2 runs of 40 steps, compile ~1 min each). Not yet run on a GPU
# (its summary step was checked on a CPU run's records).
set -u
source bench/device/setup.sh
out="$1"
for coef in 0 0.01; do
  run=/tmp/load-balance-$coef
  rm -rf "$run"
  timeout 280 python3 -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 1 -m fleetscope.trainer \
    --run-dir "$run" --device cuda --model qwen3_moe --preset small --batch-size 8 --seq-len 2048 \
    --compile default --steps 40 --set profiler.enabled=false --set faults.expert_skew=1.0 \
    --set model.router_aux_loss_coef=$coef > "$out/load-balance-run-$coef.log" 2>&1
  echo "coef $coef: trainer exit status $?" | tee -a "$out/load-balance.log"
  grep -E "Error|error" "$out/load-balance-run-$coef.log" | tail -5 | tee -a "$out/load-balance.log"
  python3 - "$run" "$coef" <<'PY' | tee -a "$out/load-balance.log"
import json, statistics, sys
from fleetscope.traces.formats import read_moe_records
run, coef = sys.argv[1], sys.argv[2]
rows = [json.loads(line) for line in open(f"{run}/metrics/rank0.jsonl")]
by_step = {}
for record in read_moe_records(f"{run}/metrics/rank0.moe.jsonl"):
    counts = record.tokens_per_expert
    mean = sum(counts) / len(counts)
    by_step.setdefault(record.step, []).append(statistics.pstdev(counts) / mean)
cv = [round(sum(v) / len(v), 3) for _, v in sorted(by_step.items())]
step_ms = statistics.median(r["step_time_ms"] for r in rows[-10:])
print(f"coef {coef}: loss step0 {rows[0]['loss']:.4f} last {rows[-1]['loss']:.4f}; median step {step_ms:.1f} ms "
      f"(last 10); tokens/expert CV per step: {cv}")
PY
done
exit 0
