"""Terminal text of the advisor's findings (analysis/advise.py; duck-typed, render does not import it)."""

from __future__ import annotations

import shlex


def render_advice(advice) -> str:
    """One block per finding, largest expected gain first (ends with a newline)."""
    lines = [f"advice for {advice.run}: {len(advice.findings)} finding(s)"]
    for index, f in enumerate(advice.findings, 1):
        gain = ("gain not estimated" if f.expected_gain_ms is None else
                f"expected gain up to {f.expected_gain_ms:.2f} ms/step"
                + (f" ({f.expected_gain_pct:.0f}%)" if f.expected_gain_pct is not None else ""))
        evidence = ", ".join(f"{k}={v}" for k, v in f.evidence.items())
        lines += [f"{index}. {f.title} [{f.rule}; confidence {f.confidence}; {gain}]",
                  f"   change:   {f.change}", f"   evidence: {evidence}", f"   why:      {f.why}"]
        if getattr(f, "apply", None) is not None:
            lines.append(f"   try it:   fleetscope tune {shlex.quote(str(advice.run))} --apply {index}")
    lines += [f"note: {n}" for n in advice.notes]
    return "\n".join(lines) + "\n"
