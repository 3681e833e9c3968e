#!/usr/bin/env bash
# The whole-run timeline on a real GPU: the trainer's per-step records under CUDA timing (events resolved a step
# later, no new sync), with the anomaly trigger's change detector on, eager and under CUDA graphs, and a straggle
# planted from step 12 to 20 on one of two ranks sharing the GPU (DDP over gloo).
# On one GPU (kind nvidia-h200), from the repo root:
#   bash bench/device/timeline_check.sh "$OUT"
# Writes $OUT/timeline-check.log (each run's tail and the timeline summary of every rank).
set -u
source bench/device/setup.sh
out="$1"
log="$out/timeline-check.log"
run() {  # name, then trainer flags
  name="$1"; shift
  rm -rf "/tmp/tl-$name"
  timeout 240 python3 -m fleetscope.cli.main launch --no-postprocess --device cuda --model qwen3_moe --preset small \
    --batch-size 4 --seq-len 128 --steps 32 --profile skip_first=22,wait=1,warmup=1,active=2 \
    --run-dir "/tmp/tl-$name" "$@" > "/tmp/tl-$name.log" 2>&1
  echo "== $name: exit $?" | tee -a "$log"
  grep -E "Error|error|anomaly|trigger" "/tmp/tl-$name.log" | tail -5 | tee -a "$log"
}
run eager-1rank --nproc-per-node 1 --parallel ddp --compile none --set 'profiler.trigger=step_time>1.5x'
run graphs-1rank --nproc-per-node 1 --parallel ddp --compile reduce-overhead --set 'profiler.trigger=step_time>1.5x'
run gloo-2rank-straggle --nproc-per-node 2 --parallel ddp --compile none --set parallel.backend=gloo \
  --set faults.straggle_rank=1 --set faults.straggle_ms=40 --set faults.slow_from_step=12 --set faults.slow_until_step=20
python3 - "$log" <<'PY' 2>&1 | tee -a "$log"
import glob, json, math, sys
import numpy as np
from fleetscope.traces.timeline import read_timeline
from fleetscope.traces.layout import RunLayout
for run in sorted(glob.glob("/tmp/tl-*/")):
    layout = RunLayout.at(run)
    for path in sorted(glob.glob(run + "metrics/rank*.timeline")):
        t = read_timeline(__import__("pathlib").Path(path))
        r = t.records
        jsonl = {}
        for line in open(path.replace(".timeline", ".jsonl")):
            d = json.loads(line); jsonl[d["step"]] = d["step_time_ms"]
        diff = max(abs(float(s_ms) - jsonl[int(s)]) for s, s_ms in zip(r["step"], r["step_ms"]))
        print(f"{run} rank {t.rank}: {len(r)} records, steps {r['step'][0]}-{r['step'][-1]}, problems {t.problems}, "
              f"max |step_ms - jsonl| {diff:.4f} ms, flags {np.bincount(r['flags']).tolist()}")
        print("  step_ms", np.round(r["step_ms"], 1).tolist())
        print("  data_ms", np.round(r["data_ms"], 1).tolist())
        print("  first_collective_ms", np.round(r["first_collective_ms"], 2).tolist())
        print("  exposed_comm_ms", np.round(r["exposed_comm_ms"], 2).tolist())
    try:
        from fleetscope.analysis.cross_rank.whole_run import whole_run_section
        section = whole_run_section(layout)
        print("  whole run:", getattr(section, "verdict", section))
        print("  slow ranks:", [(s.rank, s.from_step, s.to_step, round(s.excess_pct, 1)) for s in section.slow_ranks])
    except Exception as error:  # report, keep going
        print("  whole run failed:", type(error).__name__, error)
PY
exit 0
