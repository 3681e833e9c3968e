#!/usr/bin/env bash
# On the lent GPU: how much a planted program's measured cost moves from one recording to the next. Runs
# bench/planted/corpus.py REPEATS times over the named programs (default: the ones whose gain missed the 25% bar)
# and writes $OUT/repeat.json: per program and run, planted.json's costs and step times, and the profiled steps'
# own durations (host ProfilerStep ranges) read from that run's trace; and every recording's traces as
# $OUT/repeat_traces.tar (repeatK/NAME/...).
# Usage: bash bench/device/corpus_repeat.sh "$OUT" [REPEATS] [NAME ...]
set -uo pipefail
out="${1:?usage: corpus_repeat.sh OUT [REPEATS] [NAME ...]}"
repeats="${2:-3}"
shift; shift || true
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    names=(host_syncs_tolist_metric host_syncs_item_per_layer host_syncs_bool_mask syncs_and_foreach_optimizer
           pageable_copy_many_tensors gc_and_pageable_copy attention_and_checkpoint attention_and_recompute
           tiny_batch_mlp)
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$out/gpu.txt" 2>&1
for run in $(seq 1 "$repeats"); do
    rm -rf "/tmp/repeat$run"
    PYTHONUNBUFFERED=1 python3 bench/planted/corpus.py "/tmp/repeat$run" "${names[@]}" 2>&1 | tee -a "$out/repeat.log"
done
python3 - "$repeats" "$out/repeat.json" "${names[@]}" <<'PY'
import gzip, json, sys
from pathlib import Path
repeats, target, names = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
found = {}
for name in names:
    runs = []
    for run in range(1, repeats + 1):
        folder = Path(f"/tmp/repeat{run}") / name
        planted = folder / "planted.json"
        record = json.loads(planted.read_text()) if planted.is_file() else {"error": "no planted.json"}
        steps = []
        for trace in folder.glob("*.pt.trace.json*"):
            opener = gzip.open if trace.name.endswith(".gz") else open
            with opener(trace, "rt") as handle:
                events = json.load(handle).get("traceEvents", [])
            steps += [e["dur"] / 1000.0 for e in events
                      if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")]
        record["profiled_host_step_ms"] = steps
        runs.append(record)
    found[name] = runs
target.write_text(json.dumps(found, indent=1) + "\n")
PY
# the traces themselves, so each recording's gains can be scored against that recording's own planted cost
tar -cf "$out/repeat_traces.tar" --exclude='.compile_cache' --exclude='tmp' -C /tmp $(for run in $(seq 1 "$repeats"); do echo "repeat$run"; done)
ls -la "$out"
