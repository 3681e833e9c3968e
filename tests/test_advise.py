"""The advisor: each rule fires on its evidence with the exact change, and stays silent on a healthy run."""


import json

import pytest

from fleetscope.analysis.advise import Evidence, advise, advise_evidence
from fleetscope.analysis.advise.model import TRACE_DATA_SOURCE
from fleetscope.analysis.cross_rank.causes import CAUSE_HOST, CAUSE_SLOW_DEVICE, StepWhatIf, StragglerCause
from fleetscope.analysis.per_rank.host_stalls import IDLE_ALLOCATOR
from fleetscope.analysis.quantities import JobStraggler
from fleetscope.analysis.render.advice_terminal import gain_text
from fleetscope.cli.main import main
from fleetscope.traces.environment import usable_cpus

CONFIG = {"parallel": {"mode": "ddp", "bucket_cap_mb": 25.0}, "data": {"num_workers": 0},
          "performance": {"compile": "none", "activation_checkpointing": "none", "alloc_conf": ""}}
HEALTHY = dict(step_ms=100.0, data_ms=1.0, comm_exposed_ms=2.0, peak_allocated_mb=1000.0, peak_reserved_mb=1100.0,
               basis="gpu", idle_pct=5.0, exposed_comm_pct=2.0, overlap_pct=80.0, config=CONFIG)


def _rules(**changes) -> dict:
    if changes.get("stragglers") and "job_straggler" not in changes:
        top = max(changes["stragglers"], key=lambda f: f.wait_share)   # the report's verdict names it
        changes["job_straggler"] = JobStraggler(rank=top.rank, caused_us=1.0, share=top.wait_share, times_last=4,
                                                collectives=8, consistent=True, windows=(0,))
    return {f.rule: f for f in advise_evidence(Evidence(**{**HEALTHY, **changes})).findings}


def _cause(cause: str, **extra) -> StragglerCause:
    fields = dict(rank=3, cause=cause, explained_share=0.9, wait_share=0.9, late_instances=4,
                  median_lateness_us=20_000.0, mean_lateness_us=20_000.0, mean_extra_compute_us=0.0,
                  mean_extra_idle_us=20_000.0, mean_carried_us=0.0, op_duration_ratio=1.0, ops_compared=10,
                  expected_slowdown_us=0.0, clock_uncertainty_us=0.0, phase="", phase_vs_peers_pct=None,
                  what_if=[StepWhatIf(step=1, step_time_ms=100.0, caused_wait_ms=20.0, projected_step_ms=80.0)],
                  explanation="rank 3 is late")
    return StragglerCause(**{**fields, **extra})


def test_a_healthy_run_gets_no_advice():
    assert _rules() == {}


def test_data_loading_asks_for_workers_with_its_gain():
    finding = _rules(data_ms=30.0)["data_workers"]
    assert finding.change == "--set data.num_workers=8 --set data.persistent_workers=true"
    assert (finding.expected_gain_ms, finding.expected_gain_pct, finding.confidence) == (30.0, 30.0, "high")
    assert "data_workers" not in _rules(data_ms=30.0, config={**CONFIG, "data": {"num_workers": 4}})


def test_loading_the_gpu_waits_for_is_a_cause_below_the_loading_share():
    # 7 ms of a 100 ms step loading data: under DATA_SHARE, but where the GPU stood idle for it the step pays it
    assert "data_workers" in _rules(data_ms=7.0, idle_cause_ms={"input wait": 7.2})
    # the same loading under the GPU's queue (no input-wait idle), or on a trace without the GPU's timeline
    assert "data_workers" not in _rules(data_ms=7.0, idle_cause_ms={"input wait": 0.4})
    assert "data_workers" not in _rules(data_ms=7.0, idle_cause_ms={"input wait": 7.2}, basis="cpu")


def test_a_loaders_gain_loses_only_the_profilers_cost_of_the_events_it_records():
    """HiFi-GAN (heldout9) resamples audio in numpy in its DataLoader: 71.4 ms a profiled step of 351 ms, 233 ms
    unprofiled. The profiler lengthened the step's 30,000 recorded events, not the loader's numpy (4 events in
    it): its gain stays about 71 ms (71.8 planted), where scaling it by the steps' ratio gave 47."""
    loader = dict(data_ms=71.4, data_source=TRACE_DATA_SOURCE, step_ms=233.0, profiled_step_ms=351.0,
                  step_basis="steady steps 5-20 (step metrics)", idle_cause_ms={"input wait": 71.4})
    numpy_loader = _rules(**loader, data_loader_events=4.0, host_events=30_000.0)["data_workers"]
    assert numpy_loader.expected_gain_ms == pytest.approx(71.4 - 4 * 118.0 / 30_000, rel=1e-3)
    assert "without the profiler" in numpy_loader.why
    # a loader of torch ops holds the events, and so the profiler's cost: half of them, half the step's excess
    torch_loader = _rules(**loader, data_loader_events=15_000.0, host_events=30_000.0)["data_workers"]
    assert torch_loader.expected_gain_ms == pytest.approx(71.4 - 59.0, rel=1e-3)
    # more than MAX_PROFILER_EVENT_US per event is no profiler's cost alone: the steps' ratio, as before
    noisy = _rules(**loader, data_loader_events=4.0, host_events=1000.0)["data_workers"]
    assert noisy.expected_gain_ms == pytest.approx(71.4 * 233.0 / 351.0, rel=1e-3)


def test_data_workers_fit_the_cpus_each_rank_has():
    # a 2-core host running 2 ranks: one worker each would already take every core the training needs
    assert _rules(data_ms=30.0, cpus_per_rank=1)["data_workers"].apply.train_args[1] == "data.num_workers=1"
    finding = _rules(data_ms=30.0, cpus_per_rank=4)["data_workers"]
    assert finding.apply.train_args[1] == "data.num_workers=3" and "4 CPU(s) per rank" in finding.change
    assert _rules(data_ms=30.0, cpus_per_rank=64)["data_workers"].apply.train_args[1] == "data.num_workers=8"
    inputs = _rules(stragglers=[_cause(CAUSE_HOST, data_loader_excess_ms=18.0)], cpus_per_rank=2)["straggler"]
    assert inputs.apply.train_args[1] == "data.num_workers=1"


def test_cpus_per_rank_come_from_the_run_record():
    from fleetscope.analysis.advise.evidence import _cpus_per_rank
    local = {"spec": {"scheduler": "local", "nproc_per_node": 2}, "environment": {"cpus": 2}}
    assert _cpus_per_rank(local) == 1
    slurm = {"spec": {"scheduler": "submitit", "nproc_per_node": 8, "slurm": {"cpus_per_task": 12}},
             "environment": {"cpus": 4}}               # the submitting host's CPUs say nothing of the nodes'
    assert _cpus_per_rank(slurm) == 12
    assert _cpus_per_rank({**slurm, "spec": {**slurm["spec"], "slurm": {"cpus_per_task": 0}}}) is None
    assert _cpus_per_rank({"spec": {"scheduler": "local", "nproc_per_node": True}, "environment": {"cpus": 8}}) is None


def test_gpu_idle_asks_for_cuda_graphs_or_plain_compile_under_fsdp():
    launches = dict(idle_pct=40.0, launch_ms=20.0, launch_idle_ms=20.0, launches=900.0)  # inside launch calls
    finding = _rules(**launches)["cuda_graphs"]
    assert finding.change == "--compile reduce-overhead"
    assert finding.expected_gain_ms == pytest.approx(20.0)          # half of 40% of a 100 ms step
    fsdp = {**CONFIG, "parallel": {"mode": "fsdp"}}
    assert _rules(**launches, config=fsdp)["cuda_graphs"].change == "--compile default"
    assert "cuda_graphs" not in _rules(**launches, basis="cpu")
    # compiled in default mode, Inductor's wrapper still launches kernel by kernel: reduce-overhead replays them;
    # a run already compiled as the rule would advise is told nothing
    compiled = {**CONFIG, "performance": {**CONFIG["performance"], "compile": "default"}}
    assert _rules(**launches, config=compiled)["cuda_graphs"].change == "--compile reduce-overhead"
    compiled_fsdp = {**compiled, "parallel": {"mode": "fsdp"}}
    for config in (compiled_fsdp, {**CONFIG, "performance": {**CONFIG["performance"], "compile": "max-autotune"}}):
        assert "cuda_graphs" not in _rules(**launches, config=config)


def test_a_launch_bound_step_is_also_told_what_a_larger_batch_saves_per_sample():
    """A tiny batch (corpus tiny_batch_mlp: 4 samples a step, the GPU idle 93% of it): graphs replay the launches,
    but the host's per-step time (dispatch, the loop's Python) also stays the same over a larger batch while the
    GPU's busy time grows into it, so per sample the step can fall by up to its idle share; the GPU's wait for
    input is per sample and stays."""
    from fleetscope.analysis.advise.host import LARGER_BATCH_KEY, RULES
    launch_bound = dict(idle_pct=90.0, launch_ms=30.0, launches=3000.0, idle_cause_ms={"short gaps": 60.0})
    finding = _rules(**launch_bound)["cuda_graphs"]
    assert finding.evidence[LARGER_BATCH_KEY] == pytest.approx(90.0)
    rule = next(rule for rule in RULES if rule.name == "cuda_graphs")
    assert "a larger batch per step: up to 90% less time per sample" in rule.change_in_user_code(finding)
    # 20 ms of the 90 ms idle wait for input: 70% per sample
    waiting = _rules(**{**launch_bound, "idle_cause_ms": {"short gaps": 60.0, "input wait": 20.0}})["cuda_graphs"]
    assert waiting.evidence[LARGER_BATCH_KEY] == pytest.approx(70.0)
    # the steady step's idle where the run gives it: profiled 150 ms, 135 of it idle (busy 15 ms); steady 100 ms
    steady = _rules(**launch_bound, profiled_step_ms=150.0, step_basis="step metrics, steps 3-9")["cuda_graphs"]
    assert steady.evidence[LARGER_BATCH_KEY] == pytest.approx(85.0)


def test_gpu_idle_without_launches_is_host_work_not_cuda_graphs():
    # 40 ms idle per 100 ms step, 35 of it while the host was busy elsewhere, 1 ms in launch calls
    rules = _rules(idle_pct=40.0, launch_ms=1.0, launches=30.0, idle_cause_ms={"host busy elsewhere": 35.0})
    assert "cuda_graphs" not in rules
    assert rules["host_work"].expected_gain_ms == pytest.approx(35.0) and rules["host_work"].apply is None
    assert "launch" in rules["host_work"].why and "would not help" in rules["host_work"].why
    # short gaps between back-to-back kernels are launch-bound even when the launch calls are quick
    assert "cuda_graphs" in _rules(idle_pct=40.0, launch_ms=1.0, idle_cause_ms={"short gaps": 30.0})


def test_idle_after_syncs_asks_to_remove_them():
    finding = _rules(idle_cause_ms={"host sync": 15.0}, syncs=2.0, tensor_reads=24.0)["host_syncs"]
    assert ".item()" in finding.change and finding.expected_gain_ms == pytest.approx(15.0)


def test_the_python_use_of_values_read_keeps_its_time_on_the_steady_step():
    """corpus host_syncs_tolist_metric: 8 .tolist() reads a step, their values compared in Python (1.05 ms a
    step) up to the host's next recorded event, so the use records none: the profiler's cost per event leaves it
    as it is (19.0 ms profiled, 17.4 steady over 480 events: 3.3 us an event). Scaled by the steps' ratio it fell
    30% short of the 1.55 ms the fix saved."""
    syncs = dict(syncs=8.0, value_use_saving_ms=1.05, idle_pct=60.0, launch_paced_idle_ms=10.6,
                 idle_cause_ms={"host sync": 0.12, "host busy elsewhere": 11.0})
    steady = dict(step_ms=17.4, profiled_step_ms=19.0, step_basis="step metrics, steps 3-9", host_events=480.0)
    finding = _rules(**syncs, **steady)["host_syncs"]
    assert finding.expected_gain_ms == pytest.approx(0.12 + 1.05)
    # where the profiler's cost per event cannot be told (no count of the events), the steps' ratio, as before
    ratio = _rules(**syncs, **{**steady, "host_events": None})["host_syncs"]
    assert ratio.expected_gain_ms == pytest.approx(0.12 + 1.05 * 17.4 / 19.0)


def test_time_the_profiler_does_not_lengthen_is_not_scaled_to_the_steady_step():
    # profiled steps 1.5x the steady one: what the host did around the calls shrinks with the step, the driver's
    # time inside cudaMalloc/cudaFree and the recomputed GPU work do not
    steady = dict(step_ms=100.0, profiled_step_ms=150.0, step_basis="step metrics, steps 3-9")
    churn = _rules(**steady, allocator_calls=184.0, allocator_ms=20.0, allocator_idle_ms=12.0,
                   idle_cause_ms={IDLE_ALLOCATOR: 18.0})["allocator_churn"]
    assert churn.expected_gain_ms == pytest.approx(12.0 + 6.0 * 100.0 / 150.0)
    recompute = _rules(**steady, recompute_ms=12.0, recompute_idle_ms=3.0)["activation_checkpointing"]
    assert recompute.expected_gain_ms == pytest.approx(12.0 + 3.0 * 100.0 / 150.0)
    # a pageable copy is scaled whole: its staging is the host's memcpy, which runs as fast as the host does
    copies = _rules(**steady, pageable_copy_ms=20.0, pageable_copies=1.0, pageable_copy_refill_ms=6.0)
    assert copies["pinned_copies"].expected_gain_ms == pytest.approx((10.0 + 6.0) * 100.0 / 150.0)
    # a step that ran longer unprofiled (the host slower when nothing recorded it): host-side time grows with it
    slower = dict(step_ms=100.0, profiled_step_ms=80.0, step_basis="step metrics, steps 3-9")
    work = _rules(**slower, idle_pct=40.0, launch_ms=1.0, launches=30.0, idle_cause_ms={"host busy elsewhere": 20.0})
    assert work["host_work"].expected_gain_ms == pytest.approx(20.0 * 100.0 / 80.0)


def test_a_gain_that_recovers_idle_is_no_more_than_the_steady_steps_idle():
    """Profiled 150 ms, 60% idle: the kernels are busy 60 ms, which the profiler does not lengthen; the steady
    step is 100 ms, so it holds at most 40 ms of idle. 80 ms of dispatch scaled by the steps' ratio (53.3 ms)
    would be more than the idle there is. Each cause keeps its share of the 90 ms profiled idle: every cause's idle
    shrinks as the step does, not the found one's alone."""
    steady = dict(step_ms=100.0, profiled_step_ms=150.0, step_basis="step metrics, steps 3-9", idle_pct=60.0)
    assert _rules(**steady, launch_ms=90.0, launch_idle_ms=90.0, launches=9000.0)["cuda_graphs"].expected_gain_ms == pytest.approx(40.0)
    assert _rules(**steady, launch_ms=80.0, launch_idle_ms=80.0, launches=9000.0)["cuda_graphs"].expected_gain_ms == \
        pytest.approx(40.0 * 80.0 / 90.0)
    work = _rules(**steady, launch_ms=1.0, launches=30.0, idle_cause_ms={"host busy elsewhere": 75.0})
    assert work["host_work"].expected_gain_ms == pytest.approx(40.0 * 75.0 / 90.0)
    # a lighter step is scaled the same way: by the idle's ratio (25 ms steady of 75 profiled), which is below
    # the steps' ratio wherever the kernels take any time (30 ms of launches scaled by the steps' ratio: 20 ms)
    light = dict(steady, idle_pct=50.0)
    assert _rules(**light, launch_ms=30.0, launch_idle_ms=30.0, launches=4000.0)["cuda_graphs"].expected_gain_ms == pytest.approx(10.0)


def test_a_folder_of_traces_takes_the_profilers_cost_of_its_dispatch_ops_off_the_dispatch_idle():
    """A trace alone (no steady step): 60 ms of dispatch idle in a 100 ms profiled step with 8,000 ops and runtime
    calls recorded in it, on a host whose launch calls take 6 us as recorded: 3 us each (half a launch call) is
    the profiler's, 24 ms; 36 ms is left. Where the run recorded its steady step, the idle is scaled by it
    instead and nothing comes off twice; without a launch call to tell the host's speed, nothing comes off."""
    trace = dict(step_ms=100.0, profiled_step_ms=100.0, step_basis="trace, profiled steps 2-3", idle_pct=70.0,
                 launch_ms=20.0, launches=3000.0, idle_cause_ms={"short gaps": 10.0}, launch_paced_idle_ms=50.0,
                 dispatch_ops=8000.0)
    finding = _rules(**trace, launch_call_us=6.0)["cuda_graphs"]
    assert finding.expected_gain_ms == pytest.approx(36.0)
    assert finding.evidence["profiler_dispatch_ms_per_step"] == pytest.approx(24.0)
    assert _rules(**trace, launch_call_us=None)["cuda_graphs"].expected_gain_ms == pytest.approx(60.0)
    steady = dict(trace, step_ms=70.0, step_basis="step metrics, steps 3-9", launch_call_us=6.0)
    kept = _rules(**steady)["cuda_graphs"]   # idle room 70 - 30 = 40 ms, the dispatch's share 60/70 of it
    assert kept.expected_gain_ms == pytest.approx(40.0 * 60.0 / 70.0)
    assert "profiler_dispatch_ms_per_step" not in kept.evidence


def test_the_idle_inside_cudnn_attentions_calls_is_told_to_fix_the_shapes_not_to_move_host_work():
    """A 100 ms profiled step, 70% idle: 50 ms of it while the host was inside cuDNN attention's forward and
    backward calls (a plan built per new sequence length), 15 ms of other host work. The ops' idle is found as
    theirs, forward and backward together, with the change for cuDNN attention; host work keeps only its own 15
    ms. A copy's long call is no op setup (pinned_copies reads copies)."""
    trace = dict(step_ms=100.0, profiled_step_ms=100.0, step_basis="trace, profiled steps 2-3", idle_pct=70.0,
                 launch_ms=1.0, launches=200.0, idle_cause_ms={"host busy elsewhere": 65.0})
    held = {"aten::_cudnn_attention_backward": 30.0, "aten::_cudnn_attention_forward": 20.0}
    rules = _rules(**trace, op_held_idle_ms=held)
    assert rules["op_host_call"].expected_gain_ms == pytest.approx(50.0)
    assert "cuDNN attention" in rules["op_host_call"].change and "pad" in rules["op_host_call"].change
    assert rules["host_work"].expected_gain_ms == pytest.approx(15.0)
    assert "op_host_call" not in _rules(**trace, op_held_idle_ms={"aten::copy_": 50.0})
    assert "op_host_call" not in _rules(**trace, op_held_idle_ms={"aten::_cudnn_attention_forward": 5.0})


def test_a_foreach_optimizer_over_a_group_per_parameter_is_told_to_merge_its_groups():
    """182 groups (layer-wise lr decay, a group per parameter): each foreach op is called once per group, 241
    times a step, so the host spends 54.6 ms launching what runs 6 ms on the GPU. One or two calls a step is a
    foreach optimizer as it should be, whatever its host time."""
    grouped = dict(optimizer="AdamW", optimizer_impl="foreach", optimizer_host_ms=54.6, optimizer_launches=1333.0,
                   optimizer_gpu_ms=6.0)
    finding = _rules(**grouped, optimizer_foreach_calls=241.0)["optimizer_impl"]
    assert finding.expected_gain_ms == pytest.approx(48.6)
    assert "fewer parameter groups" in finding.change and "fused=True" in finding.change
    assert finding.evidence["foreach_calls_per_step"] == 241.0
    assert "optimizer_impl" not in _rules(**grouped, optimizer_foreach_calls=2.0)
    # many groups whose launches the GPU's own time covers cost nothing
    assert "optimizer_impl" not in _rules(**{**grouped, "optimizer_gpu_ms": 50.0}, optimizer_foreach_calls=241.0)


def test_exposed_ddp_communication_asks_for_smaller_buckets_unless_a_straggler_explains_it():
    finding = _rules(exposed_comm_pct=30.0, comm_exposed_ms=30.0, overlap_pct=10.0)["gradient_buckets"]
    assert finding.change == "--set parallel.bucket_cap_mb=12.5" and finding.expected_gain_ms == 15.0
    waiting = _rules(exposed_comm_pct=30.0, overlap_pct=10.0, stragglers=[_cause(CAUSE_HOST)])
    assert "gradient_buckets" not in waiting


def test_many_tiny_buckets_ask_for_larger_ones_even_beside_a_straggler():
    """12 all-reduces of 0.07 MiB per step (bucket_cap_mb=0.01): latency-bound, the fix is FEWER buckets."""
    tiny = {**CONFIG, "parallel": {"mode": "ddp", "bucket_cap_mb": 0.01}}
    evidence = dict(exposed_comm_pct=45.0, comm_exposed_ms=12.0, overlap_pct=30.0, comm_buckets=12.0, comm_mb=0.8,
                    comm_last_bucket_mb=0.06, config=tiny)
    finding = _rules(**evidence, stragglers=[_cause(CAUSE_HOST)])["gradient_buckets"]
    assert finding.change == "--set parallel.bucket_cap_mb=25"
    assert finding.apply.train_args == ("--set", "parallel.bucket_cap_mb=25")
    assert finding.evidence["buckets_per_step"] == 12 and finding.evidence["expected_buckets"] == 1
    assert finding.expected_gain_ms == pytest.approx(12.0 * (1 - 1 / 12))     # exposed x all-reduces removed
    # without sizes in the metrics, the trace's collectives per step and the configured cap say the same
    bare = _rules(exposed_comm_pct=45.0, comm_exposed_ms=12.0, overlap_pct=30.0, trace_collectives_per_step=13.0,
                  config=tiny)["gradient_buckets"]
    assert bare.apply.train_args == ("--set", "parallel.bucket_cap_mb=25")


def test_one_large_late_bucket_asks_for_smaller_ones_and_a_small_model_gets_nothing():
    big = {**CONFIG, "parallel": {"mode": "ddp", "bucket_cap_mb": 200.0}}
    late = dict(exposed_comm_pct=30.0, comm_exposed_ms=30.0, overlap_pct=5.0, comm_buckets=1.0, comm_last_bucket_mb=100.0)
    finding = _rules(**late, comm_mb=100.0, config=big)["gradient_buckets"]
    assert finding.change == "--set parallel.bucket_cap_mb=25" and finding.evidence["expected_buckets"] == 4
    assert finding.expected_gain_ms == pytest.approx(15.0)
    # 0.8 MiB of gradients fit any bucket: no size splits them, so no advice
    assert "gradient_buckets" not in _rules(**{**late, "comm_last_bucket_mb": 0.8}, comm_mb=0.8)


def test_every_knob_finding_states_the_change_it_applies():
    from fleetscope.analysis.advise import RULES

    evidence = Evidence(**{**HEALTHY, "data_ms": 30.0, "idle_pct": 40.0, "launch_ms": 20.0, "exposed_comm_pct": 30.0,
                           "overlap_pct": 10.0,
                           "peak_reserved_mb": 2000.0, "alloc_retries": 3})
    findings = [f for f in (rule(evidence) for rule in RULES) if f is not None]
    assert {f.rule for f in findings} == {"data_workers", "cuda_graphs", "gradient_buckets", "allocator",
                                          "memory_pressure"}
    for finding in findings:
        assert finding.apply is not None and finding.change.startswith(finding.apply.command_text())
    device = _rules(stragglers=[_cause(CAUSE_SLOW_DEVICE)])["straggler"]
    assert device.apply is None                       # replacing a GPU is not a relaunch setting
    inputs = _rules(stragglers=[_cause(CAUSE_HOST, data_loader_excess_ms=18.0)])["straggler"]
    assert inputs.apply.train_args == ("--set", "data.num_workers=8", "--set", "data.persistent_workers=true")


def test_fragmentation_and_retries_ask_for_expandable_segments_and_checkpointing():
    rules = _rules(peak_reserved_mb=2000.0, alloc_retries=3)
    assert rules["allocator"].change.startswith("--set performance.alloc_conf=expandable_segments:True")
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in rules["allocator"].change
    kept = {**CONFIG, "performance": {**CONFIG["performance"], "alloc_conf": "max_split_size_mb:128"}}
    merged = _rules(peak_reserved_mb=2000.0, config=kept)["allocator"].apply
    assert merged.train_args == ("--set", "performance.alloc_conf=max_split_size_mb:128,expandable_segments:True")
    assert rules["memory_pressure"].change == "--set performance.activation_checkpointing=selective"
    assert set(_rules(peak_reserved_mb=1500.0)) == {"allocator"}


def test_a_work_imbalance_names_routing_only_where_the_moe_view_holds_a_hot_expert_on_the_rank():
    from fleetscope.analysis.cross_rank.causes import CAUSE_WORK
    plain = _rules(stragglers=[_cause(CAUSE_WORK, concentrated_kernels=["flash_fwd (1.8x, +3.0 ms)"])])["straggler"]
    assert "router" not in plain.change and "load-balancing" not in plain.change and plain.apply is None
    assert "flash_fwd (1.8x, +3.0 ms)" in plain.change and "tokens per step" in plain.change
    moe = {**CONFIG, "model": {"family": "qwen3_moe"}}
    hot = _rules(stragglers=[_cause(CAUSE_WORK, routing="uneven routing: expert 3 (layer 0) on rank 3")],
                 config=moe)["straggler"]
    assert hot.change.startswith("uneven routing: expert 3 (layer 0) on rank 3: --set model.router_aux_loss_coef=")
    assert hot.apply.train_args == ("--set", "model.router_aux_loss_coef=0.01")


def test_a_slow_device_straggler_gets_its_remedy_and_what_if_gain():
    finding = _rules(stragglers=[_cause(CAUSE_SLOW_DEVICE)])["straggler"]
    assert "exclude" in finding.change and finding.expected_gain_ms == 20.0
    input_wait = _rules(stragglers=[_cause(CAUSE_HOST, data_loader_excess_ms=18.0)])["straggler"]
    assert input_wait.change.startswith("--set data.num_workers=8") and "input wait" in input_wait.title


@pytest.mark.slow
def test_a_real_run_with_slow_data_loading_on_rank_0(tmp_path, capsys):
    from helpers import fleetscope

    run_dir = tmp_path / "run"
    completed = fleetscope("launch", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--parallel", "ddp",
                           "--device", "cpu",
                           "--steps", "10", "--profile", "wait=1,warmup=1,active=6,repeat=1",
                           "--set", "faults.data_delay_rank=0", "--set", "faults.data_delay_ms=100")
    # 6 profiled steps: the straggler is named only when its lateness stands out from the steps' spread, and two
    # ranks on a loaded 2-core machine make 3 steps too few to say so every time; a 100 ms sleep (30 ms was not
    # named once, with the suite and a busy loop beside it on 2 cores) stands out of any spread load makes
    assert completed.returncode == 0, completed.stderr[-4000:]
    rules = {f.rule: f for f in advise(run_dir).findings}
    data = rules["data_workers"]
    assert data.evidence["data_source"] == "trace DataLoader ranges"
    assert 100.0 <= data.evidence["data_ms"] < 200.0, data.evidence        # the 100 ms sleep, plus the fetch
    straggler = rules["straggler"]
    assert straggler.evidence["rank"] == 0 and "input wait" in straggler.title
    assert main(["advise", str(run_dir), "--json", str(tmp_path / "advice.json")]) == 0
    # as many workers as the host gives each of the 2 ranks, one CPU left to the training process (1 to 8)
    workers = max(1, min(8, usable_cpus() // 2 - 1))
    assert f"--set data.num_workers={workers}" in capsys.readouterr().out
    assert (tmp_path / "advice.json").is_file()
    # advise is a view of the report: the report shows the same findings, with the same gains, next to its verdict
    report = json.loads((run_dir / "report" / "report.json").read_text())
    shown = [(f["rule"], f["gain"]) for f in report["advice"]]
    assert shown == [(f.rule, gain_text(f)) for f in advise(run_dir).findings[:len(shown)]] and shown
    assert "rank 0 is the straggler" in report["verdict"] and straggler.ranks == [0]
    assert "advice 1: " in completed.stdout


def test_attention_on_materialised_scores_is_costed_by_all_its_passes_not_the_softmax_alone():
    # 3 ms of softmax in a 100 ms step is under SOFTMAX_SHARE; the 11 ms of passes over the scores the trace's
    # shapes show (masking, scaling, dropout, their backward) are what a fused kernel removes
    assert "eager_attention" not in _rules(softmax_ms=3.0)
    finding = _rules(softmax_ms=3.0, score_pass_ms=11.0, score_shapes=["[128,8,256,256]"])["eager_attention"]
    assert finding.expected_gain_ms == pytest.approx(11.0 * 0.95)
    assert "eager_attention" not in _rules(softmax_ms=3.0, score_pass_ms=11.0, fused_attention_ms=4.0)
