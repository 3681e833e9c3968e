"""The memory family: the caching allocator and the memory headroom of the step."""

from __future__ import annotations

from .model import Evidence, Finding, Rule, settings_change, trainer_change

FRAGMENTATION_RATIO = 1.3
"""Reserved / allocated peak memory above this: the caching allocator holds fragmented blocks."""
EXPANDABLE = "expandable_segments:True"


def allocator(e: Evidence) -> Finding | None:
    """Reserved over FRAGMENTATION_RATIO x allocated peak memory, or allocator retries, without expandable
    segments: the caching allocator fragments (retries free its cache and synchronize). No time estimate."""
    if "expandable_segments" in str(e.setting("performance", "alloc_conf", "")):
        return None
    ratio = (e.peak_reserved_mb / e.peak_allocated_mb) if e.peak_reserved_mb and e.peak_allocated_mb else None
    if not e.alloc_retries and (ratio is None or ratio < FRAGMENTATION_RATIO):
        return None
    evidence = {"alloc_retries": e.alloc_retries}
    if ratio is not None:
        evidence.update(peak_reserved_mb=round(e.peak_reserved_mb, 1), peak_allocated_mb=round(e.peak_allocated_mb, 1))
    current = str(e.setting("performance", "alloc_conf", "") or "")
    conf = f"{current},{EXPANDABLE}" if current else EXPANDABLE
    return Finding(rule="allocator", title="the CUDA caching allocator fragments", evidence=evidence,
                   expected_gain_ms=None, expected_gain_pct=None, confidence="high" if e.alloc_retries else "medium",
                   **trainer_change(settings_change(f"performance.alloc_conf={conf}"),
                                    note=f"PYTORCH_ALLOC_CONF={conf} for other programs"),
                   why="reserved memory well above what tensors use, or allocation retries (each one frees the cache "
                       "and synchronizes); expandable segments grow one mapping instead of caching odd-sized blocks")


def memory_pressure(e: Evidence) -> Finding | None:
    """Out-of-memory errors or allocator retries without activation checkpointing: trade recompute for memory."""
    if e.setting("performance", "activation_checkpointing", "none") != "none" or not (e.ooms or e.alloc_retries):
        return None
    return Finding(rule="memory_pressure", title="the step runs out of memory headroom",
                   evidence={"ooms": e.ooms, "alloc_retries": e.alloc_retries},
                   expected_gain_ms=None, expected_gain_pct=None, confidence="medium",
                   **trainer_change(settings_change("performance.activation_checkpointing=selective")),
                   why="activations are recomputed in backward instead of kept: less peak memory (room for the "
                       "allocator, or a larger batch) for about a third more compute in the checkpointed blocks")


RULES = (
    Rule(find=allocator, recovers="allocator",
         in_user_code=f"PYTORCH_ALLOC_CONF={EXPANDABLE} in every rank's environment"),
    Rule(find=memory_pressure, recovers="memory",
         in_user_code="activation checkpointing (torch.utils.checkpoint) in the largest blocks, or a smaller batch"),
)
