"""The advisor's structure: every rule the engine runs belongs to one family module, and its family registers
both changes the rule makes, the one for fleetscope's trainer and the one in user code (or says why the
finding's change already is code). A rule added without its user-code change, or outside a family, fails here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from fleetscope.analysis import advise
from fleetscope.analysis.advise import FAMILIES, REGISTRY, RULES, Evidence, Rule, advise_evidence
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, CAUSE_SLOW_DEVICE
from fleetscope.analysis.quantities import JobStraggler
from test_advise import CONFIG, HEALTHY, _cause
from test_advise_moe import _section

FAMILY_NAMES = {"parallelism", "input", "host", "gpu_work", "communication", "memory", "moe"}
PROGRAM = "python train.py"
ONE_NODE = {rank: "node0" for rank in range(4)}
CASES = {
    "knobs": dict(data_ms=30.0, idle_pct=40.0, launch_ms=20.0, exposed_comm_pct=30.0, overlap_pct=10.0,
                  peak_reserved_mb=2000.0, alloc_retries=3),
    "host work": dict(idle_pct=40.0, launch_ms=1.0, launches=30.0, idle_cause_ms={"host busy elsewhere": 35.0}),
    "host syncs": dict(idle_cause_ms={"host sync": 15.0}, syncs=2.0, tensor_reads=24.0),
    "pageable copies": dict(pageable_copy_ms=20.0, pageable_copies=1.0,
                            stall_frames={"pageable copy": ["train.py(40): step"]}),
    "slow device": dict(stragglers=[_cause(CAUSE_SLOW_DEVICE)]),
    "input wait": dict(stragglers=[_cause(CAUSE_HOST, data_loader_excess_ms=18.0)]),
    "hot expert": dict(moe=_section(), rank_hosts=ONE_NODE, config={**CONFIG, "model": {"family": "mixtral"}}),
    "costly exchange": dict(moe=_section([700.0] * 4, hot_ms=2.0, a2a_ms=14.0), rank_hosts=ONE_NODE),
    "fp32 matmuls": dict(idle_pct=2.0, gemm_ms_by_precision={"fp32": 60.0, "bf16/fp16": 1.0}),
    "per-parameter optimizer": dict(optimizer="AdamW", optimizer_impl="per-parameter", optimizer_host_ms=25.0,
                                    optimizer_launches=2000.0, optimizer_gpu_ms=4.0),
    "allocator churn": dict(allocator_calls=184.0, allocator_ms=12.0, allocator_idle_ms=9.0),
    "recomputing the forward": dict(recompute_ms=8.0, recompute_idle_ms=3.0),
    "collecting garbage": dict(idle_pct=60.0, gc_ms=20.0, gc_count=1.0, idle_cause_ms={"garbage collection": 18.0}),
    "recompiling": dict(compile_ms=900.0, compile_ids=4),
    "hand-written attention": dict(idle_pct=5.0, softmax_ms=12.0),
    "an op's long host call": dict(idle_pct=60.0, idle_cause_ms={"host busy elsewhere": 50.0},
                                   op_held_idle_ms={"aten::_cudnn_attention_forward": 40.0}),
    "checkpoint each step": dict(idle_pct=90.0, host_copies=34.0, host_copy_ms=6.0,
                                 idle_cause_ms={"host busy elsewhere": 80.0}),
}
"""Evidence that, case by case, fires every rule (a new rule needs a case here, and so gets the checks below)."""


def _findings(case: str, program: str = "") -> dict:
    changes = dict(CASES[case])
    if changes.get("stragglers"):        # the report's verdict names the rank
        top = changes["stragglers"][0]
        changes["job_straggler"] = JobStraggler(rank=top.rank, caused_us=1.0, share=top.wait_share, times_last=4,
                                                collectives=8, consistent=True, windows=(0,))
    evidence = Evidence(**{**HEALTHY, **changes, "program": program})
    return {f.rule: f for f in advise_evidence(evidence).findings}


def test_the_engine_runs_the_rules_of_seven_families_each_rule_once():
    assert {family.__name__.rpartition(".")[2] for family in FAMILIES} == FAMILY_NAMES
    owners = {rule.name: [family.__name__ for family in FAMILIES if rule in family.RULES] for rule in REGISTRY}
    assert len(owners) == len(REGISTRY) and all(len(names) == 1 for names in owners.values()), owners
    for rule in REGISTRY:
        (family,) = owners[rule.name]
        assert rule.find.__module__ == family or rule.find.__module__.startswith(family + "."), rule.name
    assert RULES == tuple(rule.find for rule in REGISTRY)


def test_every_rule_shaped_function_of_the_package_is_registered():
    # Evidence in, Finding or None out: a rule that no family registers would never run
    registered = {rule.find for rule in REGISTRY}
    for info in pkgutil.walk_packages(advise.__path__, advise.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__ and function.__annotations__.get("return") == "Finding | None":
                assert function in registered, f"{module.__name__}.{name} is not in its family's RULES"


@pytest.mark.parametrize("rule", REGISTRY, ids=lambda rule: rule.name)
def test_each_rule_has_its_user_code_change_or_says_why_its_change_already_is_code(rule):
    assert (rule.in_user_code is not None) != bool(rule.change_is_code)


def test_a_rule_with_neither_or_both_is_refused():
    with pytest.raises(ValueError, match="exactly one"):
        Rule(find=RULES[0])
    with pytest.raises(ValueError, match="exactly one"):
        Rule(find=RULES[0], in_user_code="a code change", change_is_code="its change is code")


def test_the_cases_fire_every_rule():
    assert {name for case in CASES for name in _findings(case)} == {rule.name for rule in REGISTRY}


@pytest.mark.parametrize("case", CASES)
def test_a_trainer_change_reads_as_user_code_where_another_program_ran(case):
    rules = {rule.name: rule for rule in REGISTRY}
    trainer, program = _findings(case), _findings(case, PROGRAM)
    assert trainer.keys() == program.keys()
    for name, finding in trainer.items():
        theirs = program[name]
        assert theirs.apply is None and theirs.evidence["program"] == PROGRAM
        if finding.apply is not None:
            assert rules[name].in_user_code is not None, f"{name} changes the trainer but has no user-code change"
            assert theirs.change != finding.change, name
            assert "--set" not in theirs.change and "--compile" not in theirs.change, name
        elif rules[name].change_is_code:
            assert theirs.change == finding.change, name
