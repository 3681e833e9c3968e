"""A tour of the Python API on a recorded pair of traces (or any two runs, trace directories or trace files):

    python docs/examples/api_tour.py tests/fixtures/gpu/planted_pairs/more_tokens/traces/rank0.pt.trace.json.gz \\
        tests/fixtures/gpu/planted_pairs/more_tokens/traces/rank1.pt.trace.json.gz

Prints the verdict, the step time with its definition, the top finding, the kernels with the most GPU time (from
the event table, as pandas), and the largest changes from the first to the second.
"""

import sys

import fleetscope


def main(first: str, second: str) -> int:
    run = fleetscope.open_run(first)
    print("verdict:", run.report.verdict)
    print(f"step time: {run.report.step_time.median_ms:.2f} ms ({run.report.step_time_basis})")
    if run.advice.findings:
        top = run.advice.findings[0]
        print(f"top finding: {top.title} [{top.rule}], up to {top.expected_gain_ms or 0:.2f} ms a step")
    events = run.events(rank=run.ranks[0])
    kernels = events[events["kind"] == "kernel"].groupby("name")["dur_us"].sum().nlargest(3)
    print("most GPU time:", "; ".join(f"{name[:50]} {us / 1000:.2f} ms" for name, us in kernels.items()))
    change = fleetscope.diff(first, second)
    print(f"{second} against {first}: the mean step span {change.span_change_ms:+.2f} ms; largest changes:")
    for item in change.items[:3]:
        print(f"  {item.change_ms:+.3f} ms  {item.name[:60]} {item.status}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
