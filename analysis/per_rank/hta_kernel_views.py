"""HTA 0.5.0's temporal breakdown, comm/comp overlap and kernel breakdown of one rank, step for step as
HTA computes them, except that each kernel's type comes from one `get_kernel_type` call per distinct kernel
name instead of a row-by-row `DataFrame.apply` (which is most of those views' cost in HTA: about 100 us per
kernel, three times per rank). Same HTA helpers (`merge_kernel_intervals`, `_get_gpu_kernel_type_time`,
`_aggr_gpu_kernel_time`), same order of operations, so the same numbers; tests/test_per_rank_hta_fast_path.py
holds them equal to HTA's own calls.
"""

from __future__ import annotations

from typing import Any

DURATION_RATIO = 0.8
NUM_KERNELS = 10
"""HTA's get_gpu_kernel_breakdown defaults (TraceAnalysis: include_memory_kernels=True)."""


def _gpu_kernels(trace_df):
    """HTA's `trace_df[stream != -1].copy()` (what these views call GPU kernels)."""
    return trace_df[trace_df["stream"].ne(-1)].copy()


def _kernel_types(gpu_kernels, symbols: list[str]):
    from hta.utils.utils import get_kernel_type

    ids = gpu_kernels["name"]
    types = {i: get_kernel_type(symbols[i]) for i in ids.unique().tolist()}
    return ids.map(types)


def temporal_breakdown(trace_df, symbols: list[str], rank: int):
    """HTA's BreakdownAnalysis.get_temporal_breakdown for one rank."""
    import pandas as pd
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.utils.utils import KernelType, merge_kernel_intervals

    gpu_kernels = _gpu_kernels(trace_df)
    idle_time, kernel_time = BreakdownAnalysis._get_idle_time_for_kernels(gpu_kernels)
    gpu_kernels["kernel_type"] = _kernel_types(gpu_kernels, symbols)
    comp_kernels = merge_kernel_intervals(
        gpu_kernels[gpu_kernels["kernel_type"].eq(KernelType.COMPUTATION.name)].copy())
    compute_time = comp_kernels.end.sum() - comp_kernels.ts.sum()
    non_compute_time = kernel_time - compute_time - idle_time
    assert idle_time <= kernel_time
    assert compute_time <= kernel_time
    assert non_compute_time >= 0
    result = pd.DataFrame({"rank": [rank], "idle_time(us)": [idle_time], "compute_time(us)": [compute_time],
                           "non_compute_time(us)": [non_compute_time], "kernel_time(us)": [kernel_time]})
    for part in ("idle_time", "compute_time", "non_compute_time"):
        result[part] = result[f"{part}(us)"] / result["kernel_time(us)"]
        result[f"{part}_pctg"] = round(100 * result[part], 2)
    return result[["rank", "idle_time(us)", "compute_time(us)", "non_compute_time(us)", "kernel_time(us)",
                   "idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg"]]


def comm_comp_overlap(trace_df, symbols: list[str], rank: int):
    """HTA's CommunicationAnalysis.get_comm_comp_overlap for one rank."""
    import pandas as pd
    from hta.utils.utils import KernelType, merge_kernel_intervals

    gpu_kernels = _gpu_kernels(trace_df)
    gpu_kernels["kernel_type"] = _kernel_types(gpu_kernels, symbols)
    comp = merge_kernel_intervals(gpu_kernels[gpu_kernels["kernel_type"].eq(KernelType.COMPUTATION.name)].copy())
    comm = merge_kernel_intervals(gpu_kernels[gpu_kernels["kernel_type"].eq(KernelType.COMMUNICATION.name)].copy())
    status = (pd.concat([comm.melt(var_name="status", value_name="time").replace({"ts": 1, "end": -1}),
                         comp.melt(var_name="status", value_name="time").replace({"ts": 2, "end": -2})])
              .sort_values(by="time").reset_index(drop=True))
    status["running"] = status["status"].cumsum()
    overlap = status[status["running"].eq(3)]
    shifted = overlap.merge(status.shift(-1).dropna(), left_index=True, right_index=True)
    ratio = (shifted["time_y"] - shifted["time_x"]).sum() / (comm["end"] - comm["ts"]).sum()
    result = pd.DataFrame({"rank": [rank], "comp_comm_overlap_ratio": [ratio]})
    result["comp_comm_overlap_pctg"] = round(100 * result["comp_comm_overlap_ratio"], 2)
    return result[["rank", "comp_comm_overlap_pctg"]]


def kernel_breakdown(trace_df, symbols: list[str], rank: int) -> tuple[Any, Any]:
    """HTA's BreakdownAnalysis.get_gpu_kernel_breakdown for one rank: (time per kernel type, unnormalized:
    `kernel_type`, `sum`; per-kernel rows, HTA's columns). The cross-rank totals are joined elsewhere."""
    import pandas as pd
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.utils.utils import KernelType

    kinds = [KernelType.COMPUTATION.name, KernelType.COMMUNICATION.name, KernelType.MEMORY.name]
    gpu_kernels = _gpu_kernels(trace_df)
    gpu_kernels["kernel_type"] = _kernel_types(gpu_kernels, symbols)
    gpu_kernels["name"] = gpu_kernels["name"].map(dict(enumerate(symbols)))
    by_type = BreakdownAnalysis._get_gpu_kernel_type_time(gpu_kernels, kinds)
    per_kernel = []
    for kind in kinds:
        rows = BreakdownAnalysis._aggr_gpu_kernel_time(gpu_kernels[gpu_kernels["kernel_type"] == kind],
                                                       duration_ratio=DURATION_RATIO, num_kernels=NUM_KERNELS)
        rows["kernel_type"] = kind
        rows["rank"] = int(rank)
        per_kernel.append(rows)
    kernels = pd.concat(per_kernel, ignore_index=True).rename(columns={
        "sum": "sum (us)", "mean": "mean (us)", "max": "max (us)", "min": "min (us)", "std": "stddev"})
    return by_type, kernels[["name", "sum (us)", "max (us)", "min (us)", "stddev", "mean (us)", "kernel_type",
                             "rank"]]

