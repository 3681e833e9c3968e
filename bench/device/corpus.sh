#!/usr/bin/env bash
# On the lent H200: record the ground-truth corpus (bench/planted/corpus.py) and bring it back through $OUT as
# a few tarballs under the transfer limits (8 files, 16 MiB each), then the held-out programs
# (bench/planted/heldout.py) as heldout.tar. Usage: bash bench/device/corpus.sh "$OUT" [NAME ...] (default: all)
set -uo pipefail
out="${1:?usage: corpus.sh OUT [NAME ...]}"
shift
work=/tmp/corpus
rm -rf "$work" && mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$out/gpu.txt" 2>&1
PYTHONUNBUFFERED=1 python3 bench/planted/corpus.py "$work" "$@" 2>&1 | tee "$out/corpus.log"
PYTHONUNBUFFERED=1 python3 bench/planted/heldout.py /tmp/heldout 2>&1 | tee "$out/heldout.log"
tar -cf "$out/heldout.tar" -C /tmp heldout
# pack the program folders into tarballs of at most ~14 MiB each
python3 - "$work" "$out" <<'PY'
import os, sys, tarfile
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
limit, part, size, tar = 14 << 20, 0, 0, None
for program in sorted(p for p in work.iterdir() if p.is_dir() and not p.name.startswith(".")):
    files = [f for f in program.rglob("*") if f.is_file() and "tmp" not in f.relative_to(program).parts]
    need = sum(f.stat().st_size for f in files)
    if tar is None or size + need > limit:
        if tar is not None:
            tar.close()
        if part == 6:
            print(f"out of tarballs at {program.name}: the rest stays behind"); break
        tar, size, part = tarfile.open(out / f"corpus{part}.tar", "w"), 0, part + 1
    for f in files:
        tar.add(f, arcname=str(f.relative_to(work)))
    size += need
if tar is not None:
    tar.close()
PY
ls -la "$out"
