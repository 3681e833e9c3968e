"""A CPU straggler whose peers all share its host: the verdict says the lateness can be that host's contention
(two ranks on one shared host, each a step behind the other by turns), with no node or device to exclude."""

from types import SimpleNamespace

from fleetscope.analysis.cross_rank.causes import (
    CAUSE_HOST,
    CAUSE_WORK,
    StragglerCause,
    explain,
    shares_cpu_host,
)
from fleetscope.analysis.cross_rank.stragglers import Significance
from fleetscope.analysis.report.build import _cause_clause


def _finding(*, cause=CAUSE_HOST, has_gpu=False, host_peers=(1,), ranks=2) -> StragglerCause:
    return StragglerCause(
        rank=0, cause=cause, explained_share=0.68, wait_share=1.0, late_instances=6, median_lateness_us=19_920.0,
        mean_lateness_us=21_460.0, mean_extra_compute_us=3_000.0, mean_extra_idle_us=10_470.0,
        mean_carried_us=9_250.0, op_duration_ratio=1.0, ops_compared=10, expected_slowdown_us=0.0,
        clock_uncertainty_us=0.0, phase="", phase_vs_peers_pct=None, has_gpu=has_gpu, host_peers=list(host_peers),
        significance=Significance(rank=0, steps=3, ranks=ranks, lateness_vs_peers_us=20_450.0, spread_us=1_780.0))


def test_a_cpu_rank_sharing_its_host_with_every_peer_is_said_to_be_contention_maybe():
    f = _finding()
    assert shares_cpu_host(f)
    text = explain(f)
    assert "all 2 ranks run on one host and share its CPU cores" in text
    assert "leaves a collective 9.25 ms after its peers" in text
    assert "no node or device to exclude" in text
    clause = _cause_clause([SimpleNamespace(causes=SimpleNamespace(findings=[f]))], 0)
    assert clause == "; cause: host-side delay (its peers share its host's CPU cores: this can be that host's contention)"


def test_a_gpu_rank_a_rank_with_peers_elsewhere_or_more_work_gets_no_contention_clause():
    for f in (_finding(has_gpu=True), _finding(host_peers=(1,), ranks=4), _finding(cause=CAUSE_WORK)):
        assert not shares_cpu_host(f)
        assert "share its CPU cores" not in explain(f)
    assert _cause_clause([SimpleNamespace(causes=SimpleNamespace(findings=[_finding(has_gpu=True)]))], 0) == \
        "; cause: host-side delay"
