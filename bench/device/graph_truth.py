"""What replaying the whole step as one CUDA graph saves, measured: the ground truth for `cuda_graphs`' gain on
the corpus's healthy programs and its launch-bound ones (bench/planted/corpus.py).

A healthy program is one with nothing planted, not one measured to have nothing to gain: on a host whose CPU
launches slowly, an eager step can wait for its launches without anyone planting it. This script times each
program's step eagerly and with the same step captured once and replayed (the optimizer made capturable in
both, so the GPU work is the same), each the median of TIMED steps between two synchronizes, profiler off.
Run it in the same call as the programs' recordings (`corpus.py OUT NAMES`), so truth and trace share a host.

    python3 bench/device/graph_truth.py OUT.json [NAMES...]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "planted"))
import corpus  # noqa: E402  (the corpus's builders, not a package)

PROGRAMS = ("healthy_sdpa_bf16", "healthy_bf16_mlp", "healthy_conv_channels_last", "launch_bound_tiny_layers",
            "tiny_batch_mlp")
WARMUP, TIMED = 5, 25


def capturable_fused_adamw(model, lr: float = 1e-4) -> torch.optim.AdamW:
    params = model.parameters() if isinstance(model, torch.nn.Module) else model
    return torch.optim.AdamW(params, lr=lr, fused=True, capturable=True)


def median_ms(step, dev) -> float:
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(TIMED):
        dev.sync()
        start = time.perf_counter()
        step()
        dev.sync()
        times.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times)


def measure(name: str, dev) -> dict:
    spec = corpus.PROGRAMS[name]
    row = {"program": name}
    for variant in ("eager", "graphed"):
        with corpus.isolated(dev):
            prog = spec.build(dev, frozenset())
            step = corpus.graphed(dev, prog.step) if variant == "graphed" else prog.step
            row[f"{variant}_ms"] = round(median_ms(step, dev) * prog.scale, 3)
            prog.close()
            del prog, step
    row["graph_saves_ms"] = round(row["eager_ms"] - row["graphed_ms"], 3)
    row["graph_saves_pct"] = round(100.0 * row["graph_saves_ms"] / row["eager_ms"], 1)
    return row


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    names = argv[1:] or list(PROGRAMS)
    corpus.fused_adamw = capturable_fused_adamw   # the builders' optimizer, capturable in both variants
    # without a GPU (a smoke run of the script) the sizes are the corpus's tiny ones and there is no graph
    dev = corpus.Dev(torch.device("cuda" if torch.cuda.is_available() else "cpu"), Path("/tmp/graph_truth"))
    rows = []
    for name in names:
        try:
            rows.append(measure(name, dev))
        except Exception as error:   # one program that cannot be captured is reported, the others still run
            rows.append({"program": name, "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if dev.gpu else "cpu"
    out.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows},
                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
