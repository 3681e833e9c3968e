"""The host family: the host launching kernels, busy with other work, or draining the GPU at syncs."""

from __future__ import annotations

from fleetscope.analysis.per_rank.events import LONG_HOST_OP_US
from fleetscope.analysis.per_rank.host_stalls import (FRAME_PAGEABLE_COPY, FRAME_SYNC, IDLE_GC, IDLE_HOST, IDLE_INPUT,
                                                     IDLE_SHORT)

from .gpu_work import activation_checkpointing, allocator_churn, optimizer_impl
from .model import (Change, Evidence, Finding, Rule, idle_gain, idle_room_ms, profiled_scale, profiler_event_us,
                    step_gain, trace_gain, trainer_change, unprofiled_dispatch_ms, unprofiled_range_ms)

IDLE_SHARE = 0.25
"""GPU idle above this share of the span (GPU basis) points at launch overhead."""
LAUNCH_EVIDENCE_SHARE = 0.3
"""The host is launch-bound when its time inside launch calls is at least this share of the GPU's idle time,
or when short gaps between back-to-back kernels are most of that idle time."""
HOST_WORK_SHARE = 0.5
"""Where the step dispatches kernel by kernel, host work must hold this share of the GPU's idle (host_work); a
checkpoint's host time too (checkpoint_in_step)."""
HOST_WORK_STEP_SHARE = 0.10
"""GPU idle "host busy elsewhere" that no other rule explains, above this share of the step: the host is busy
with other work (a second cause beside dispatch counts as well as a lone one)."""
SYNC_SHARE = 0.10
"""GPU idle after host syncs above this share of the step: the step drains the GPU at syncs."""
SYNCS_INSIDE_STEP = 2.0
"""At least this many syncs per step: some are inside the step, not only a read at its end. No CUDA graph
replays such a step (the host must see each value before it goes on), so a host-bound step that syncs this
often is told to remove the syncs first, whatever they cost by themselves."""
PAGEABLE_COPY_SHARE = 0.10
"""Host time inside copies from or to pageable memory above this share of the step: pin the memory."""
PAGEABLE_RECOVERABLE = 0.5
"""Share of that time pinned, non-blocking copies are assumed to recover: the host no longer waits for the copy
(it can overlap the step's work), and a pinned copy runs without the staging through a bounce buffer (about
twice the bandwidth of a pageable one on PCIe hosts); the copy itself still takes time."""
FRAMES_NAMED = 2
"""Program frames named in a finding's change (the costliest first)."""


def _launch_bound(e: Evidence, idle_ms: float) -> bool:
    """The GPU's idle time is launch overhead: the host inside launch calls for LAUNCH_EVIDENCE_SHARE of it, or
    short gaps between back-to-back kernels, gaps paced by launch calls (host_stalls.py
    DISPATCH_INTERVAL_FACTOR) and the launch calls themselves for most of it. How many launches a step makes says nothing by itself: a step of
    Python work, syncs or a per-parameter optimizer launches as often."""
    dispatch = e.idle_cause_ms.get("short gaps", 0.0) + e.launch_paced_idle_ms
    inside = e.launch_ms or 0.0
    return inside >= LAUNCH_EVIDENCE_SHARE * idle_ms or dispatch + inside >= 0.5 * idle_ms


def _other_host_causes(e: Evidence) -> list[str]:
    """What else in the step holds the GPU back and that no CUDA graph removes (or that prevents capture)."""
    causes = []
    if e.graph_launches >= 1.0:
        causes.append("the step already replays CUDA graphs")
    if _syncs_block_graphs(e):
        causes.append("host syncs")
    if allocator_churn(e) is not None:
        causes.append("allocator calls")
    if optimizer_impl(e) is not None:
        causes.append("an optimizer launched per parameter or per group")
    if pinned_copies(e) is not None:   # a copy from pageable memory cannot be captured in a graph
        causes.append("copies from pageable memory")
    return causes


def _syncs_block_graphs(e: Evidence) -> bool:
    """A step that syncs with the host (a device read or synchronize in every step) and loses time there
    cannot be captured as one CUDA graph: host_syncs comes first. (One sync at a step's end still lets its
    compiled regions replay as graphs.)"""
    per_step = _syncs_per_step(e)
    return per_step >= SYNCS_INSIDE_STEP or (per_step >= 1.0 and host_syncs(e) is not None)


def _syncs_per_step(e: Evidence) -> float:
    """Host syncs per step: the sync calls, or the device reads where the trace records no sync call (a read
    holds its sync: counting both would count one `.item()` twice)."""
    return max(e.syncs or 0.0, e.tensor_reads or 0.0)


def cuda_graphs(e: Evidence) -> Finding | None:
    """GPU idle over IDLE_SHARE of the span (GPU basis), not compiled or compiled in `default` mode, and the
    evidence is launches (_launch_bound: the host's time inside launch calls, or short gaps between back-to-back
    kernels): the host cannot launch kernels fast enough. CUDA graphs (`reduce-overhead`; plain `default` under
    FSDP, whose parameters move) replay the step's launches; a step compiled in `default` mode still launches
    each kernel from Inductor's Python wrapper, which `reduce-overhead` replaces with a graph's replay. Gain: the
    idle time that is dispatch (short gaps between back-to-back kernels and gaps paced by launch calls,
    host_stalls.py; at least the host's time inside launch calls while the GPU is idle), not an assumed share of
    all idle.
    A GPU waiting for other host work is host_work's, not this rule's; a step that drains the GPU at host
    syncs cannot be captured as a graph (host_syncs first)."""
    compiled = e.setting("performance", "compile", "none")
    mode = "default" if str(e.setting("parallel", "mode", "")).startswith("fsdp") else "reduce-overhead"
    if compiled not in ("none", "default") or compiled == mode:   # already compiled as this rule would advise
        return None
    if e.basis != "gpu" or e.idle_pct is None or e.idle_pct < 100 * IDLE_SHARE or not e.step_ms:
        return None
    idle_ms = e.idle_pct / 100 * e.trace_step_ms
    if not _launch_bound(e, idle_ms) or _other_host_causes(e):
        return None
    profiled_dispatch_ms = e.idle_cause_ms.get("short gaps", 0.0) + e.launch_paced_idle_ms
    # a folder of traces has no steady step to scale to: the profiler's own cost of the ops recorded in the
    # dispatch gaps comes off instead (it lengthens dispatch most: thousands of events, each recorded)
    profiler_ms = profiled_dispatch_ms - unprofiled_dispatch_ms(e, profiled_dispatch_ms)
    # at least the host's time inside launch calls while the GPU waited (the calls while it runs cost nothing)
    dispatch_ms = min(max(profiled_dispatch_ms - profiler_ms, e.launch_idle_ms), idle_ms)
    if activation_checkpointing(e) is not None:   # the recomputation's own dispatch is that finding's
        dispatch_ms = max(dispatch_ms - e.recompute_idle_ms, 0.0)
    gain, pct = idle_gain(e, dispatch_ms)
    per_sample_pct = larger_batch_per_sample_pct(e, idle_ms)
    evidence = {"gpu_idle_pct": round(e.idle_pct, 1), "launch_ms_per_step": round(e.launch_ms or 0.0, 3),
                "launches_per_step": round(e.launches or 0.0, 1), "compile": compiled,
                "short_gap_idle_ms_per_step": round(e.idle_cause_ms.get("short gaps", 0.0), 3),
                "syncs_per_step": round((e.syncs or 0.0) + (e.tensor_reads or 0.0), 1),
                "allocator_calls_per_step": round(e.allocator_calls or 0.0, 1),
                LARGER_BATCH_KEY: round(per_sample_pct, 1)}
    profiler_note = ""
    if profiler_ms > 0.0:
        evidence["profiler_dispatch_ms_per_step"] = round(profiler_ms, 3)
        profiler_note = (f"; of the {profiled_dispatch_ms:.2f} ms of dispatch idle, {profiler_ms:.2f} ms is the "
                         f"profiler's own cost ({e.dispatch_ops:.0f} ops and runtime calls recorded in it, "
                         f"~{profiler_event_us(e):.1f} us each: half this host's median launch call), not counted")
    return Finding(rule="cuda_graphs", title="the GPU waits for the host to launch kernels",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   **trainer_change(Change(train_args=("--compile", mode))),
                   why=f"the GPU is idle {e.idle_pct:.0f}% of the profiled steps ({idle_ms:.2f} ms per step) and the "
                       f"host spends {e.launch_ms or 0.0:.2f} ms of it inside {e.launches or 0.0:.0f} launch calls "
                       f"({e.idle_cause_ms.get('short gaps', 0.0):.2f} ms in short gaps between kernels"
                       f"{profiler_note}); ruled out: "
                       "host syncs, allocator calls, a per-parameter optimizer and copies from pageable memory (none "
                       "significant in the step). The host does little but dispatch; compiling fuses "
                       "kernels and " + ("CUDA graphs replay the launches without the host" if mode == "reduce-overhead"
                                         else "cuts launches (CUDA graphs need fixed parameter addresses, which FSDP "
                                              "does not keep)")
                       + f". A larger batch spreads the same per-step host time over more samples instead: up to "
                         f"{per_sample_pct:.0f}% less time per sample, as the GPU's busy time grows to fill the step")


LARGER_BATCH_KEY = "larger_batch_per_sample_pct"
"""The evidence key of larger_batch_per_sample_pct's figure."""


def larger_batch_per_sample_pct(e: Evidence, idle_ms: float) -> float:
    """How much less time per sample a larger batch could take, in percent: a step whose GPU waits for the host's
    per-step work (dispatch, the loop's and the optimizer's Python) takes about as long with more samples until
    the GPU's busy time fills it, so per sample the step falls by up to its idle share; the GPU's wait for input
    (IDLE_INPUT) is per sample and stays. The steady step's idle where the run gives it (idle_room_ms), the
    profiled step's otherwise. An upper bound: kernels that already fill the GPU grow with the batch."""
    input_share = min(e.idle_cause_ms.get(IDLE_INPUT, 0.0) / idle_ms, 1.0) if idle_ms > 0 else 0.0
    room_ms = idle_room_ms(e)
    if room_ms is not None and e.step_ms:
        return 100.0 * room_ms * (1.0 - input_share) / e.step_ms
    return 100.0 * max(idle_ms * (1.0 - input_share), 0.0) / e.trace_step_ms if e.trace_step_ms else 0.0


def op_host_call(e: Evidence) -> Finding | None:
    """The GPU idle while the host was inside one long call of an op that hands the GPU work (host_stalls.py
    op_held_idle_us), for at least HOST_WORK_STEP_SHARE of the step: the op's own host side holds the GPU (cuDNN
    building a plan or timing algorithms for a new shape, a library's setup), not the program's dispatch or its
    work that launches nothing. Ops whose change is the same count together (forward and backward). Copies are
    pinned_copies'. Gain: that idle."""
    if e.basis != "gpu" or not e.op_held_idle_ms or not e.step_ms:
        return None
    by_change: dict[str, list[str]] = {}
    for op in e.op_held_idle_ms:
        if op not in COPY_OPS:
            by_change.setdefault(_op_call_change(op), []).append(op)
    if not by_change:
        return None
    change, ops = max(by_change.items(), key=lambda item: sum(e.op_held_idle_ms[op] for op in item[1]))
    held_ms = sum(e.op_held_idle_ms[op] for op in ops)
    if held_ms < HOST_WORK_STEP_SHARE * e.trace_step_ms:
        return None
    gain, pct = idle_gain(e, held_ms)
    named = ", ".join(f"{op} {e.op_held_idle_ms[op]:.1f} ms" for op in ops[:FRAMES_NAMED + 1])
    return Finding(rule="op_host_call", title="the GPU waits while the host is inside one op's call",
                   evidence={"op_held_idle_ms_per_step": round(held_ms, 3), "ops": named,
                             "launch_paced_idle_ms_per_step": round(e.launch_paced_idle_ms, 3)},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium", change=change,
                   why=f"{held_ms:.2f} ms per profiled step of the GPU's idle falls inside calls of {named} that "
                       f"lasted {LONG_HOST_OP_US / 1000:.0f} ms or more and launched GPU work: the op's own host "
                       "side held the GPU, not dispatch (gaps paced by launches are not counted) nor work that "
                       "launches nothing. A cost that comes with each new input shape is largest in a run's first "
                       "steps: profile later steps to see whether it lasts")


COPY_OPS = frozenset({"aten::copy_", "aten::_to_copy", "aten::to", "aten::_copy_from", "aten::_copy_from_and_resize"})
"""Ops whose long call is a copy (pinned_copies reads those), not an op's own setup."""


def _op_call_change(op: str) -> str:
    """The change for an op whose host call holds the GPU, in the program's terms."""
    if "cudnn_attention" in op:
        return ("cuDNN attention builds an execution plan for each new input shape (sequence length, batch): pad "
                "the sequences to a few fixed lengths, or run scaled_dot_product_attention on the flash or "
                "memory-efficient backend (with torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, "
                "SDPBackend.EFFICIENT_ATTENTION]): ...)")
    if "convolution" in op:
        return ("cuDNN chooses a convolution algorithm for each new input shape (and times them all with "
                "torch.backends.cudnn.benchmark=True): keep the input shapes fixed (pad or bucket them), or set "
                "torch.backends.cudnn.benchmark = False where they vary")
    return (f"{op}'s host call holds the GPU: keep its input shapes fixed where a new shape makes the library set up "
            "again (a plan, an autotune, a compile), or move the work it does on the host off the step")


def host_work(e: Evidence) -> Finding | None:
    """GPU idle, and of it at least HOST_WORK_STEP_SHARE of the step "host busy elsewhere"
    that no other rule explains: not dispatch (gaps paced by launch calls are cuda_graphs'), not a checkpoint,
    a per-parameter optimizer, the allocator or compilation (their own rules'). The host is busy with work that
    launches nothing (tensors built on the CPU, Python, tokenization, garbage collection, I/O). Gain, an upper
    bound: that idle time per step. No setting fixes it: the change is in code."""
    if e.basis != "gpu" or e.idle_pct is None or e.idle_pct < 100 * HOST_WORK_STEP_SHARE or not e.step_ms:
        return None
    if checkpoint_in_step(e) is not None:
        return None  # the checkpoint's finding claims this host time
    idle_ms = e.idle_pct / 100 * e.trace_step_ms
    busy_ms = (e.idle_cause_ms.get("host busy elsewhere", 0.0) - e.launch_paced_idle_ms - _explained_host_ms(e)
               - sum(e.op_held_idle_ms.values()))   # the host inside an op's long call: op_host_call's
    # gaps paced by launch calls are dispatch (cuda_graphs', subtracted above); where the step syncs inside,
    # the host's dispatch after each sync looks like other work: there the rest must be most of the idle;
    # elsewhere a tenth of the step is a cause of its own, beside dispatch or alone
    syncing = _syncs_per_step(e) >= SYNCS_INSIDE_STEP and host_syncs(e) is not None
    if busy_ms < (HOST_WORK_SHARE * idle_ms if syncing else HOST_WORK_STEP_SHARE * e.trace_step_ms):
        return None
    gain, pct = idle_gain(e, busy_ms)
    return Finding(rule="host_work", title="the GPU waits for host work that launches nothing",
                   evidence={"gpu_idle_pct": round(e.idle_pct, 1), "host_busy_idle_ms_per_step": round(busy_ms, 3),
                             "launch_ms_per_step": round(e.launch_ms or 0.0, 3),
                             "launch_paced_idle_ms_per_step": round(e.launch_paced_idle_ms, 3)},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   change="move the host work between launches off the step: build batches and tensors on the device "
                          "(torch.randn(..., device='cuda')), tokenize and augment in DataLoader workers, keep Python "
                          "bookkeeping out of the loop (and garbage collection: gc.freeze() after setup); " + (
                              "the frames in the merged trace show which code it is" if e.python_frames else
                              "this trace has no Python frames, so it cannot tell Python work from garbage "
                              "collection: profile with with_stack=True and experimental_config=torch.profiler."
                              "_ExperimentalConfig(record_python_gc_info=True) to name the code or the collector"),
                   why=f"the GPU is idle {e.idle_pct:.0f}% of the step ({idle_ms:.2f} ms), {busy_ms:.2f} ms of it while "
                       "the host ran no op and launched nothing (the gaps where it dispatched kernels, "
                       f"{e.launch_paced_idle_ms:.2f} ms, are not counted): CUDA graphs would not help; the host's own "
                       "work holds the GPU back")


COMPILE_SHARE = 0.10
"""Host time inside torch.compile's ranges above this share of the profiled step: it compiles in the steps."""
HOST_COPIES_PER_STEP = 8.0
"""At least this many device-to-host copies by copy ops per step: tensors saved or moved to the host in the
loop (a checkpoint, a state_dict, .cpu() of the weights), not a metric read."""


def recompilation(e: Evidence) -> Finding | None:
    """torch.compile compiles inside the profiled steps (its ranges hold COMPILE_SHARE of the step): a compiled
    region whose guards fail every step (a new shape, a changing Python value) is compiled again each time.
    Gain: that host time per step (Inductor's benchmarking syncs in it are compilation, not the program's)."""
    compile_ms = e.compile_ms or 0.0
    if not e.step_ms or compile_ms < COMPILE_SHARE * e.step_ms:
        return None
    gain, pct = trace_gain(e, compile_ms)
    ids = f" ({e.compile_ids} compile ids)" if e.compile_ids else ""
    return Finding(rule="recompilation", title="torch.compile recompiles inside the steps",
                   evidence={"compile_ms_per_step": round(compile_ms, 3), "compile_ids": e.compile_ids},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="high",
                   change="keep the compiled region's guards stable: pad inputs to a few fixed shapes, or mark the "
                          "varying dimension dynamic (torch._dynamo.mark_dynamic(x, dim) or torch.compile(..., "
                          "dynamic=True)); TORCH_LOGS=recompiles names the guard that fails",
                   why=f"the host spends {compile_ms:.2f} ms per profiled step inside torch.compile's compile "
                       f"ranges{ids}: the steady steps should run compiled code, not compile it again")


def checkpoint_in_step(e: Evidence) -> Finding | None:
    """Many device-to-host copies by copy ops per step (HOST_COPIES_PER_STEP; `.item()` reads are not copy ops)
    while the GPU waits for the host most of the time no other cause explains: tensors are saved or moved to the
    host in the loop (a checkpoint every step). Gain: the idle "host busy elsewhere" (the serialization) plus the
    copies' time."""
    copies = e.host_copies or 0.0
    if e.basis != "gpu" or not e.step_ms or copies < HOST_COPIES_PER_STEP:
        return None
    busy_ms = max(e.idle_cause_ms.get(IDLE_HOST, 0.0) - e.launch_paced_idle_ms, 0.0)
    lost_ms = busy_ms + (e.host_copy_ms or 0.0)
    # the idle a collection, a sync or the allocator holds is theirs (their own rules weigh it), whatever else
    # the step does: the checkpoint must hold most of the rest
    named_ms = sum(ms for cause, ms in e.idle_cause_ms.items() if cause not in (IDLE_HOST, IDLE_SHORT))
    open_ms = max((e.idle_pct or 0.0) / 100 * e.trace_step_ms - named_ms, 0.0)
    if lost_ms < HOST_WORK_SHARE * open_ms:
        return None
    gain, pct = trace_gain(e, lost_ms)
    return Finding(rule="checkpoint_in_step", title="the step copies its tensors to the host (a checkpoint in the loop?)",
                   evidence={"host_copies_per_step": round(copies, 1),
                             "host_copy_ms_per_step": round(e.host_copy_ms or 0.0, 3),
                             "host_busy_idle_ms_per_step": round(busy_ms, 3)},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   change="save checkpoints every N steps, not every step (or asynchronously: torch.distributed."
                          "checkpoint.async_save, or copy to pinned buffers with non_blocking=True and write from a "
                          "thread); keep .cpu() of weights and state_dict() out of the training loop",
                   why=f"{copies:.0f} device-to-host copies by copy ops per step ({e.host_copy_ms or 0.0:.2f} ms of "
                       f"copying) and the GPU idle {busy_ms:.2f} ms per step while the host works without "
                       "launching: tensors are being serialized or moved to the host inside the loop")


GC_SHARE = 0.05
"""GPU idle during garbage collections above this share of the step: the collector pauses the step."""


def gc_pauses(e: Evidence) -> Finding | None:
    """The GPU idles while the host collects garbage (host_stalls.py: gaps at least half covered by a
    collection, in with_stack traces: torch.profiler's `Python GC` events, `gc.collect()` frames) for GC_SHARE
    of the step: the interpreter stops for each collection and launches nothing. Gain: that idle (a collection
    the GPU's queue covers costs nothing)."""
    lost_ms = e.idle_cause_ms.get(IDLE_GC, 0.0)
    if e.basis != "gpu" or not e.step_ms or lost_ms < GC_SHARE * e.step_ms:
        return None
    gain, pct = idle_gain(e, lost_ms)
    return Finding(rule="gc_pauses", title="garbage collection pauses the step",
                   evidence={"gc_ms_per_step": round(e.gc_ms, 3), "collections_per_step": round(e.gc_count, 1),
                             "gc_idle_ms_per_step": round(lost_ms, 3)},
                   expected_gain_ms=gain, expected_gain_pct=pct, confidence="high",
                   change="gc.freeze() after the model, optimizer and dataset are built (the long-lived heap is no "
                          "longer scanned), no gc.collect() inside the loop (collect every N steps or between "
                          "epochs; gc.disable() around the step where the program allocates many Python objects)",
                   why=f"{e.gc_count:.1f} garbage collections per step hold the host {e.gc_ms:.2f} ms, and the GPU "
                       f"idles {lost_ms:.2f} ms per step during them: each collection walks every tracked Python "
                       "object (torch's modules, a dataset index), more the larger the heap")


def _explained_host_ms(e: Evidence) -> float:
    """Host time per step that other rules explain (a per-parameter optimizer, compilation, recomputation); the
    allocator's gaps are a cause of their own (host_stalls.py IDLE_ALLOCATOR), not "host busy elsewhere"."""
    explained = 0.0
    if recompilation(e) is not None:
        explained += e.compile_ms or 0.0
    if optimizer_impl(e) is not None:
        explained += max((e.optimizer_host_ms or 0.0) - (e.optimizer_gpu_ms or 0.0), 0.0)
    if activation_checkpointing(e) is not None:
        explained += e.recompute_idle_ms
    if host_syncs(e) is not None:
        explained += e.sync_dispatch_ms
    return explained


SYNC_OP_CHANGES = {
    "aten::nonzero": "boolean-mask indexing or torch.nonzero reads a count from the GPU: keep shapes static "
                     "(torch.where(mask, x, 0), masked_fill, a fixed-size index)",
    "aten::masked_select": "masked_select reads a count from the GPU: use torch.where / masked_fill instead",
    "aten::_local_scalar_dense": ".item() (or int()/float()/bool() of a tensor, a Python `if` on one) reads a "
                                 "value from the GPU: keep it on the device and read it every N steps",
    "aten::copy_": ".cpu() / .tolist() / .numpy() copies to the host and waits: accumulate on the device, copy "
                   "every N steps, or copy non_blocking into pinned memory",
}
"""The change that removes each syncing op (host_stalls.py sync_ops), in the program's terms."""


def host_syncs(e: Evidence) -> Finding | None:
    """The step syncs with the host (a device read or synchronize per step) and that costs SYNC_SHARE of the
    step: the GPU idle the syncs left (host_stalls.py: a gap after a sync is the sync's for as long as the host
    waited in it); or, whatever that costs, a step that syncs SYNCS_INSIDE_STEP times while the GPU waits
    SYNC_SHARE of it for launches (CUDA graphs would recover that, but cannot replay a step that syncs). The change names the op (sync_ops: its host time is evidence) and, with with_stack, the
    frames."""
    per_step = _syncs_per_step(e)
    if e.basis != "gpu" or not e.step_ms or per_step < 1.0:
        return None
    idle_ms = e.idle_cause_ms.get("host sync", 0.0)
    op_ms = sum(e.sync_op_ms.values())
    # the loss: the GPU idle a sync leaves while the host's following work could have overlapped the GPU work
    # it waited for (host_stalls.py); the ops' own waits are evidence, not added (they hold that idle). Where the
    # GPU also waits for the host elsewhere, the host work of the data-dependent-shape ops themselves (their
    # backward included), which static shapes remove, shortens the step too, up to that other idle.
    other_idle_ms = max(sum(e.idle_cause_ms.values()) - idle_ms, 0.0)
    # and the program's use of the values read (a .tolist() looped over in Python), which reading nothing removes;
    # tensors copied to the host to be saved are serialized after their copies: that is checkpoint_in_step's
    use_ms = 0.0 if checkpoint_in_step(e) is not None else e.value_use_saving_ms or 0.0
    # a loop over routed groups counted by the reads: one grouped launch also removes each group's dispatch
    # (saving_reach.routed_loop_saving_us, walked to the step's end), which holds the data-dependent ops' own
    loop_ms = (e.routed_loop_saving_ms or 0.0) if _routed_groups(e) else 0.0
    host_ms = max(min(e.sync_dispatch_ms + use_ms, other_idle_ms), loop_ms)
    lost_ms = idle_ms + host_ms
    dispatch_ms = e.idle_cause_ms.get("short gaps", 0.0) + e.launch_paced_idle_ms
    blocking = per_step >= SYNCS_INSIDE_STEP and dispatch_ms >= SYNC_SHARE * e.step_ms
    if lost_ms < SYNC_SHARE * e.step_ms and not blocking:
        return None
    # scaled to the steady step only where profiling lengthens it: the host work that goes with the syncs (the
    # data-dependent ops', the program's use of the values read); the GPU's idle after a sync is the device
    # read's round trip (copy, completion, the host resuming), which the profiler does not lengthen the way it
    # lengthens host ops (bench/planted/CORPUS.md: scaled, it fell 42-55% short)
    # the use of the values read is the host's time up to its next recorded event: no event of its own, so the
    # profiler's cost per event leaves it as it is where that cost can be told (unprofiled_range_ms)
    use_part_ms = min(use_ms, host_ms) if host_ms > loop_ms else 0.0
    unprofiled_use_ms = unprofiled_range_ms(e, use_part_ms, 0.0) if use_part_ms else None
    scale = profiled_scale(e)
    host_steady_ms = (host_ms - use_part_ms) * scale + \
        (use_part_ms * scale if unprofiled_use_ms is None else unprofiled_use_ms)
    bound = idle_room_ms(e)
    gain, pct = step_gain(e, min(idle_ms + host_steady_ms, float("inf") if bound is None else bound))
    frames = e.stall_frames.get(FRAME_SYNC, [])[:FRAMES_NAMED]
    ops = list(e.sync_op_ms)[:FRAMES_NAMED]
    evidence = {"sync_idle_ms_per_step": round(idle_ms, 3), "sync_op_ms_per_step": round(op_ms, 3),
                "dynamic_shape_host_ms_per_step": round(e.sync_dispatch_ms, 3),
                "value_use_ms_per_step": round(use_ms, 3),
                **({"group_loop_ms_per_step": round(loop_ms, 3)} if loop_ms else {}),
                "syncs_per_step": round(e.syncs or 0.0, 1), "tensor_reads_per_step": round(e.tensor_reads or 0.0, 1)}
    if ops:
        evidence["sync_ops"] = "; ".join(f"{op} {e.sync_op_ms[op]:.2f} ms" for op in ops)
    if frames:
        evidence["frames"] = "; ".join(frames)
    where = f" at {' and '.join(frames)}" if frames else ""
    named = [SYNC_OP_CHANGES[op] for op in ops if op in SYNC_OP_CHANGES]
    change = (f"remove the syncs{where}: " + "; ".join(named) if named else
              f"remove the .item() / torch.cuda.synchronize() calls{where} from the step (keep values on the GPU "
              "and read them every N steps)")
    routed = _routed_groups(e)
    if routed:
        change = f"{routed}; or {change}"
        evidence["routed_gemm_weights"] = "; ".join(e.routed_gemm_weights)
        evidence["routed_gemm_launches_per_step"] = round(e.routed_gemm_launches, 1)
    return Finding(rule="host_syncs", title="the step drains the GPU at host syncs",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   change=change + ("" if frames else "; with_stack traces name the frames"),
                   why=f"{e.syncs or 0.0:.1f} syncs per step ({', '.join(ops) or 'explicit synchronize'}): the host "
                       f"spends {op_ms:.2f} ms per step in the ops that wait and the GPU idles {idle_ms:.2f} ms after "
                       "them; each one empties the GPU's queue, and no CUDA graph can capture a step that syncs"
                       + (f"; the ops whose output size depends on the data, and their backward, hold the host "
                          f"{e.sync_dispatch_ms:.2f} ms per step besides the waits, while the GPU waits for the host "
                          f"{other_idle_ms:.2f} ms elsewhere" if e.sync_dispatch_ms >= 0.01 else "")
                       + (f"; without the loop over groups, its dispatch of each group's ops (the GPU waiting for "
                          f"them) gives the step {loop_ms:.2f} ms per step" if loop_ms >= 0.01 else "")
                       + (f"; the program's use of the values read (Python on a .tolist()'s elements) holds the host "
                          f"{use_ms:.2f} ms per step while the GPU waits" if use_ms >= 0.01 else "")
                       + (f" (they also keep CUDA graphs from recovering the {dispatch_ms:.2f} ms per step the GPU "
                          "waits for launches)" if blocking and dispatch_ms > 0 else ""))


def _routed_groups(e: Evidence) -> str:
    """Where the step's GEMMs multiply one weight by many numbers of rows (step_work.routed_gemms) and it reads
    counts or values from the GPU: the change that removes both the reads and the per-group launches, in the
    program's terms; "" otherwise."""
    if not e.routed_gemm_weights or not set(e.sync_op_ms) & ROUTING_READS:
        return ""
    return (f"the GEMMs over the weights {' and '.join(e.routed_gemm_weights)} run one group of rows at a time "
            f"({e.routed_gemm_launches:.0f} launches a step), each group (an expert's tokens) counted on the host "
            "first: run them as one grouped GEMM over offsets kept on the device (torch._grouped_mm; in "
            "transformers, experts_implementation='grouped_mm'), or give each group a fixed capacity and batch "
            "them, which removes the reads and the per-group launches")


ROUTING_READS = frozenset(("aten::nonzero", "aten::masked_select", "aten::_local_scalar_dense", "aten::copy_"))
"""Sync ops by which a loop over groups learns each group's rows (torch.where, a mask, .item(), .tolist())."""


def pinned_copies(e: Evidence) -> Finding | None:
    """Host time inside copies from or to pageable memory (host_stalls.py: the copy call returns only when the
    copy is done, staged through a bounce buffer) over PAGEABLE_COPY_SHARE of the step: copy from pinned memory
    with non_blocking=True. Gain: that host time, less its wait for the GPU work queued before each copy, less the
    same bytes at a pinned copy's rate (`_pinned_rate`), which the GPU still spends on the copy; where neither the bytes nor the rate is known, the assumption
    PAGEABLE_RECOVERABLE, said so."""
    copy_ms = e.pageable_copy_ms or 0.0
    if e.basis != "gpu" or not e.step_ms or copy_ms < PAGEABLE_COPY_SHARE * e.step_ms:
        return None
    rate_gbps, rate_source = _pinned_rate(e)
    megabytes = e.pageable_copy_mb or 0.0
    # the copy's own time is its call's, less the call's wait for the work queued before it on the stream, which
    # a pinned, non-blocking copy waits for too (only the host stops waiting); the staging through the bounce
    # buffer outside the DMA's own GPU time is the pageable copy's too
    copying_ms = max(copy_ms - e.pageable_copy_queued_ms, 0.0)
    if rate_gbps > 0 and megabytes > 0:
        pinned_ms = megabytes / rate_gbps        # MB over GB/s is milliseconds
        recovered_ms = max(copying_ms - pinned_ms, 0.0)
        basis = (f"{megabytes:.0f} MB per step move at {megabytes / max(copying_ms, 1e-9):.1f} GB/s now ({copying_ms:.2f} "
                 "ms of copying: the calls' time less their wait for work queued before them); at about "
                 f"{rate_gbps:.0f} GB/s, {rate_source}, {pinned_ms:.2f} ms of copying is left")
    else:
        recovered_ms = PAGEABLE_RECOVERABLE * copying_ms
        basis = (f"gain assumed: {PAGEABLE_RECOVERABLE:.0%} of the {copying_ms:.2f} ms of copying, as "
                 + ("the trace records no copy sizes" if megabytes <= 0 else "no pinned copy rate is known for this GPU"))
    # and the GPU no longer idles after each copy while the host refills its queue (host_stalls.py)
    if e.pageable_copy_refill_ms >= 0.01:
        recovered_ms += e.pageable_copy_refill_ms
        basis += (f"; and the GPU idles {e.pageable_copy_refill_ms:.2f} ms per step after the copies while the host, "
                  "ahead of it before each copy, launches again")
    # scaled whole to the steady step: the copy's staging is the host's own memcpy, which runs slower or faster with
    # the host as its dispatch does (on the recordings, scaling it matched the planted costs as often as not)
    gain, pct = trace_gain(e, recovered_ms)
    frames = e.stall_frames.get(FRAME_PAGEABLE_COPY, [])[:FRAMES_NAMED]
    evidence = {"pageable_copy_ms_per_step": round(copy_ms, 3), "pageable_copies_per_step": round(e.pageable_copies or 0.0, 1),
                "pageable_copy_gpu_ms_per_step": round(e.pageable_copy_gpu_ms, 3),
                "pageable_copy_queued_ms_per_step": round(e.pageable_copy_queued_ms, 3),
                "pageable_copy_refill_ms_per_step": round(e.pageable_copy_refill_ms, 3),
                "pageable_copy_mb_per_step": round(megabytes, 1)}
    if rate_gbps > 0:
        evidence["pinned_copy_gbps"] = round(rate_gbps, 1)
        evidence["pinned_rate_source"] = rate_source
    if frames:
        evidence["frames"] = "; ".join(frames)
    where = f" at {' and '.join(frames)}" if frames else ""
    change = (f"copy{where} from pinned memory with non_blocking=True (tensor.pin_memory(), or "
              "DataLoader(..., pin_memory=True) for batches; allocate reused host buffers with pin_memory=True)")
    return Finding(rule="pinned_copies", title="the host waits for copies from pageable memory",
                   evidence=evidence, expected_gain_ms=gain, expected_gain_pct=pct, confidence="medium",
                   change=change,
                   why=f"the host spends {copy_ms:.2f} ms per step inside {e.pageable_copies or 0.0:.1f} copies from or "
                       "to pageable memory: each call returns only when its copy is done, staged through a bounce "
                       "buffer, so nothing on the host overlaps it; a pinned, non-blocking copy returns at once and "
                       f"moves at the link's full rate. {basis[0].upper()}{basis[1:]}")


def _pinned_rate(e: Evidence) -> tuple[float, str]:
    """The rate a pinned copy reaches on this GPU and where that figure comes from: the trace's own large pinned
    copies, else the host link table (traces/device_peaks.py); (0, "") when neither is known."""
    if e.pinned_copy_gbps > 0:
        return e.pinned_copy_gbps, "measured on this trace's own pinned copies"
    if e.host_link_gbps > 0:
        return e.host_link_gbps, f"typical of {e.host_link}"
    return 0.0, ""


RULES = (
    Rule(find=recompilation, recovers="compilation",
         change_is_code="shapes and torch.compile's options are set in the program's own code"),
    Rule(find=checkpoint_in_step, recovers="host-side time",
         change_is_code="where and how often the program saves is its own code"),
    Rule(find=cuda_graphs, recovers="host-side time",
         in_user_code=lambda finding: "torch.compile(model, mode='reduce-overhead') (CUDA graphs replay the step's "
                                      "launches; mode='default' where parameters move, as under FSDP)"
                                      + _larger_batch_change(finding)),
    Rule(find=gc_pauses, recovers="host-side time",
         change_is_code="when the collector runs is the program's own code"),
    Rule(find=op_host_call, recovers="host-side time",
         change_is_code="the op's input shapes and backend are the program's own code"),
    Rule(find=host_work, recovers="host-side time",
         change_is_code="no setting moves host work off the step: the finding's change is already a code change"),
    Rule(find=host_syncs, recovers="host syncs",
         change_is_code="no setting removes a sync from the step: the finding's change is already a code change"),
    Rule(find=pinned_copies, recovers="host-side time",
         change_is_code="the copies are the program's own: pinning their memory is a code change"),
)


def _larger_batch_change(finding: Finding) -> str:
    """The batch alternative to a launch-bound step's graphs, in the program's terms (larger_batch_per_sample_pct)."""
    pct = finding.evidence.get(LARGER_BATCH_KEY)
    if not isinstance(pct, (int, float)) or isinstance(pct, bool) or pct < 1.0:
        return ""
    return (f"; or, where memory and the optimizer allow, a larger batch per step: up to {pct:.0f}% less time per "
            "sample (the same per-step host time over more samples)")
