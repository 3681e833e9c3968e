"""Terminal text of the advisor's findings (analysis/advise/; duck-typed, render does not import it)."""

from __future__ import annotations

import shlex


def render_advice(advice) -> str:
    """One block per finding, largest expected gain first (ends with a newline)."""
    lines = [f"advice for {advice.run}: {len(advice.findings)} finding(s)"]
    for index, f in enumerate(advice.findings, 1):
        evidence = ", ".join(f"{k}={v}" for k, v in f.evidence.items())
        lines += [f"{index}. {f.title} [{f.rule}; confidence {f.confidence}; {gain_text(f)}]",
                  f"   change:   {f.change}", f"   evidence: {evidence}", f"   why:      {f.why}"]
        if getattr(f, "overlaps", None):
            lines.append(f"   overlaps: {', '.join(f.overlaps)} (the same {f.recovers}: not additive)")
        if getattr(f, "apply", None) is not None:
            lines.append(f"   try it:   fleetscope tune {shlex.quote(str(advice.run))} --apply {f.rule}")
    combined = getattr(advice, "combined_gain_ms", None)
    if combined is not None and len(advice.findings) > 1:
        lines.append(f"together at most {combined:.2f} ms/step ({100 * combined / advice.combined_gain_of_ms:.0f}% of "
                     f"{advice.combined_gain_of_ms:.2f} ms, {advice.combined_gain_basis}; overlapping findings count once)")
    lines += [f"note: {n}" for n in advice.notes]
    return "\n".join(lines) + "\n"


def gain_text(f) -> str:
    """"expected gain up to 11.76 ms/step (7% of 167.67 ms, step metrics, steady steps 4-9 (6), ...)"."""
    if f.expected_gain_ms is None:
        return "gain not estimated"
    text = f"expected gain up to {f.expected_gain_ms:.2f} ms/step"
    of_ms = getattr(f, "gain_of_ms", None)
    if f.expected_gain_pct is not None and of_ms:
        text += f" ({f.expected_gain_pct:.0f}% of {of_ms:.2f} ms, {f.gain_basis})"
    return text
