"""Is a program the corpus calls healthy bounded by its launches on the machine it runs on?

    python bench/planted/launch_probe.py OUT_JSON

A healthy program must be healthy when measured, not by intent (CORPUS.md). Whether a compiled stack keeps
its host ahead of the GPU depends on the host: on one H100 machine the launch calls of `healthy_compiled_transformer`
and `eager_attention_causal` took 300-1,450 us each (5 us typical) with the GPU idle, in the unprofiled step as
in the trace. This measures, unprofiled, the step as the corpus builds it (torch.compile default mode) against
the same model under mode='reduce-overhead' (CUDA graphs replay the launches), and the eager-attention program
against the same with SDPA, each the median of 9 synchronized steps after warm-up, three times over: a
launch-bound step is one that CUDA graphs make faster by more than the noise between the repeats.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import corpus  # noqa: E402  (the corpus's own building blocks: the same model, optimizer and step)

REPEATS = 3


def compiled_transformer(dev: corpus.Dev, mode: str) -> corpus.Program:
    """healthy_compiled_transformer's model and batch, compiled in `mode`."""
    model = corpus.transformer(dev, 1024, 4).to(dev.device)
    compiled = torch.compile(model, mode=mode)
    opt = corpus.fused_adamw(model)
    x = torch.randn(16, 2048, 1024, device=dev.device)
    return corpus.Program(lambda: corpus.fit(compiled, opt, x, amp=dev), close=corpus.reset_dynamo)


def timed(build, dev: corpus.Dev, warmup: int = 5, steps: int = 9) -> float:
    with corpus.isolated(dev):
        torch.manual_seed(0)
        program = build()
        try:
            for _ in range(warmup):
                program.step()
            return corpus.median_step_ms(program, dev, steps)
        finally:
            program.close()


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    scratch = Path(tempfile.mkdtemp())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(scratch / "triton")
    dev = corpus.Dev(device, scratch)
    eager = corpus.PROGRAMS["eager_attention_causal"]
    variants = {
        "healthy_compiled_transformer default": lambda: compiled_transformer(dev, "default"),
        "healthy_compiled_transformer reduce-overhead": lambda: compiled_transformer(dev, "reduce-overhead"),
        "eager_attention_causal as written": lambda: eager.build(dev, corpus.Fixes()),
        "eager_attention_causal with SDPA": lambda: eager.build(dev, corpus.Fixes(eager.causes)),
    }
    found: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(REPEATS):
        for name, build in variants.items():
            found[name].append(round(timed(build, dev), 3))
            print(f"{name:48s} {found[name][-1]:8.2f} ms", flush=True)
    summary = {name: {"runs_ms": runs, "median_ms": statistics.median(runs)} for name, runs in found.items()}
    summary["device"] = torch.cuda.get_device_name()
    summary["torch"] = torch.__version__
    out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
