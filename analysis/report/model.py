"""The analysis report: typed dataclasses, and their JSON form (`schema_version` below).

JSON schema (version 2; version 1 is read too: its what-ifs are all on the arithmetic basis, which is what a
what-if without `basis` reads as). Times carry their unit in the field name (`_us`, `_ms`, `_pct`).

    schema_version        int, bumped on any incompatible change (2: a straggler's what_if[].projected_step_ms comes
                          from replaying the step, where the dependency model holds it)
    created_at            ISO 8601 UTC
    source_path           the analyzed path; source_kind: "run_dir" | "trace_dir" | "trace_file"
    world_size            int | null: from job.json / distributedInfo
    complete              bool: the job completed (where its record says) and every expected rank of every window
                          was analyzed, no file was unusable
    outcome               {state (completed | failed | hung | cancelled | running), returncode, failed_first,
                          failure, exit_code, exit_meaning, then_failed[], hang, sentence} | null (no job
                          record): how the job ended (cross_rank/outcome.py); a job that did not complete leads
                          the verdict and the problems with its sentence
    problems[]            {label, window, rank, reason}: files that could not be used
    missing[]             {rank, window}: ranks with no trace in a window (the first ones of each window)
    missing_total         how many rank traces are missing in all, listed in missing[] or not
    notes[]               plain-language remarks (attempts ignored, ranks numbered by file order, ...)
    verdict               one paragraph: slowest rank, the rank others wait for
    advice[]              the advisor's top findings (analysis/advise/, the same as `fleetscope advise`): {rule,
                          title, gain (with its denominator and basis), change, confidence, ranks[], windows[],
                          overlaps[] (rules recovering the same time)}; empty when analyzed without the advisor
    step_time             StepStats over the profiled steps, per step the slowest rank's time (analysis/quantities.py):
                          {count, mean_ms, median_ms, min_ms, max_ms, std_ms}
    step_time_basis       where step_time comes from: "trace, profiled steps 2-3, 6-7, slowest rank per step"
    run_step_time_ms      the run's steady step time from step metrics (quantities.metrics_step_time_ms: the
                          median over unprofiled steps after the first of the slowest rank's step_time_ms) |
                          null (no step metrics); run_step_time_basis: its basis ("step metrics, steady steps
                          ..."); where the profiled steps are PROFILED_UNREPRESENTATIVE_PCT slower, the
                          verdict's first sentence says so
    ranks[]               RankSummary, across all windows:
        rank, host, windows, step_time (StepStats | null),
        span_us, busy_pct, idle_pct, comm_pct, overlap_pct (null: no communication), basis ("gpu" | "cpu")
    windows[]             WindowReport, one per profiling window:
        window (int | null), steps[] (step numbers seen), notes[],
        ranks[]           RankReport: rank, host, label, rank_source, backend, world_size, event_count,
                          dropped_events {reason: count}, step_source, steps[] {step, start_us, step_time_ms
                          (gpu_ms where bound is "gpu", else host_ms: per_rank/steps.py), host_ms, gpu_start_us,
                          gpu_ms, gpu_busy_ms, gpu_span_source, bound ("host" | "gpu"),
                          phases_ms {train_step, forward, backward, optimizer_step},
                          data_loader_ms (DataLoader fetch ranges; null: none), host_events (host events
                          recorded in the step), data_loader_events (of them, in the fetch ranges; null:
                          none)}, step_time (StepStats),
                          utilization {basis, span_us, busy_us, idle_us, compute_us, comm_us, memory_us,
                          overlap_us, exposed_comm_us, idle_comm_us, busy_pct, idle_pct, comm_pct,
                          overlap_pct} | null,
                          collective_source, collective_count,
                          gpu_time GpuTime | null (below, this rank's),
                          host_stalls {steps[] {step, sync_count (cudaStream/Device/EventSynchronize calls),
                          sync_us (host time blocked in them), tensor_reads (aten::_local_scalar_dense:
                          .item() and friends), dtoh_count, dtoh_us (device-to-host copies launched in
                          the step, GPU time), input_wait_us (DataLoader fetch spans, host wall), launch_count,
                          launch_us (launch calls: kernels, graphs, async copies; host time in them),
                          pageable_copy_count, pageable_copy_us (copies from or to pageable host memory;
                          host time inside their copy calls), pageable_copy_bytes (what they moved), pageable_copy_gpu_us
                          (their GPU time: the copy itself), pageable_copy_queued_us (host time in
                          the calls before each copy began while the GPU ran work queued before it),
                          pageable_copy_refill_us (GPU idle right after them, up to that wait),
                          sync_dispatch_us (host time in data-dependent-shape ops that sync, outside
                          the syncs: boolean-mask indexing and its backward, masked_select, unique)},
                          frames[] {frame, what ("sync" | "pageable copy"), count, us}: with_stack
                          traces, the program's own innermost frames holding those calls (profiled steps),
                          idle_by_cause_us {cause: us}, idle_gaps_by_cause {cause: gaps}: GPU idle time
                          inside the steps by cause, summed over the profiled steps (per step: divided by
                          len(steps); the terminal and HTML print that mean) ("input wait", "host
                          collective", "garbage collection" (with_stack traces), "allocator calls" (cudaMalloc /
                          cudaFree: a gap mostly inside them, else the part inside them), "host sync", "short gaps"
                          < 10 us, "device dependency" (the next GPU work was already launched), "host busy
                          elsewhere"; host_stalls.py), steps_span_us, steps_busy_us (idle by cause + busy =
                          span, GPU basis), sync_ops[] {op, count, us}
                          (the op whose copy to the host preceded each sync), launch_paced_idle_us (of the
                          "host busy elsewhere" idle, the gaps paced by launch calls), dispatch_ops (ops, ranges
                          and runtime calls recorded inside the short and launch-paced gaps), op_held_idle_us {op: us} (of the
                          "host busy elsewhere" idle not paced by launches, the time inside one call of at least
                          1 ms of an op that launched GPU work, by the innermost such op), launch_idle_us (host
                          time inside launch calls while the GPU was idle), launch_call_us
                          (the median launch call as recorded) | null (no launches)} | null (no steps),
                          step_work {steps, gemm_us_by_precision {fp32 | tf32 | bf16/fp16 | fp8 | unknown:
                          us per step}, conv_fp32_us (fp32 convolution kernels that are no GEMM by name: FFT,
                          Winograd, direct engines, by their launching convolution op; per step),
                          gemm_tflops_by_precision (achieved, GEMMs with recorded shapes),
                          gemm_shaped_share, device (as traces/device_peaks.py lists it, or ""),
                          gemm_peak_pct_by_precision (achieved / the device's dense peak), optimizer (its
                          class), optimizer_impl ("fused" | "foreach" | "per-parameter" | ""), optimizer_host_us, optimizer_launches, optimizer_gpu_us,
                          optimizer_foreach_calls (calls of its most-called foreach op per step: one per
                          parameter group),
                          allocator_calls (cudaMalloc/cudaFree), allocator_us, allocator_idle_us (the GPU idle
                          while in them), compile_us (inside
                          torch.compile's ranges), compile_ids, host_copies (device-to-host copies by copy
                          ops), host_copy_us, graph_launches, softmax_us, fused_attention_us, recompute_us
                          (forward work the backward ran again), recompute_idle_us (the GPU idle around it),
                          gc_us, gc_count (garbage collections, with_stack traces): per profiled step; python_frames (the trace has with_stack's);
                          score_pass_us (non-GEMM passes over a score matrix: kernels of ops with an input
                          of a shape softmax ran over), score_shapes, score_gemm_us (the GEMMs over a score
                          matrix), score_gemm_excess_us (their time beyond their math at half the program's
                          other GEMMs' rate, step_work.score_gemm_excess), score_saving_us (those passes and
                          that excess gone: what reaches the step's end, saving_reach.py; null: cannot tell),
                          fp32_saving_us (the fp32 math 4x faster: what reaches the step's end, per step,
                          saving_reach.py; null: cannot tell), value_use_saving_us (the host's use of the
                          values its syncs read gone: what reaches the step's end, saving_reach.py; null:
                          cannot tell), pinned_copy_gbps (the trace's own large
                          pinned copies' rate; 0: none), host_link, host_link_gbps (the GPU's host link and
                          a pinned copy's rate over it, traces/device_peaks.py; "", 0: not listed),
                          routed_gemm_weights[] (weights GEMMs multiplied by 8 or more numbers of rows:
                          groups of rows counted on the host, an expert loop), routed_gemm_launches (their
                          GEMM launches per step), routed_loop_saving_us (that loop's dispatch gone: what
                          reaches the step's end beyond its reads' idle, saving_reach.py; null: cannot
                          tell); step_work.py} | null (no steps or no GPU activity)
        top_kernels[]     {name, count, total_us, ranks, category}: kernels with the most GPU time, all ranks
                          summed; category as in gpu_time
        gpu_time          GpuTime, the window's ranks summed | null (no GPU activity): {total_us (kernel,
                          memcpy, memset durations summed), by_phase_us {phase: us} (the innermost
                          forward/backward/optimizer_step/train_step range containing the LAUNCH, found
                          through the CUDA correlation id; "in step, outside phases"; "outside steps"),
                          by_category_us {category: us}, category_counts {category: launches} (gemm,
                          attention, elementwise, reduction, memcpy/memset, communication, optimizer,
                          other: names.kernel_category), by_range_us {user record_function range: us}
                          (innermost range on the launching thread; top 15), by_op_us {host op: us} (the
                          innermost op that launched it, by External id; top 15)}
        clock             {reference_rank, reference_host, hosts[] {host, ranks[], offset_us, source
                          ("reference host" | "measured" | "collectives" | "none"), measured_offset_us,
                          measured_uncertainty_us, collective_offset_us, collective_spread_us,
                          collective_samples}}: offsets removed before matching collectives (clock_align.py)
        collective_matching {method ("sequence numbers" | "order" | "sequence numbers and order" | null: no
                          collectives), groups[] {group (process group label; "" for calls naming none), method,
                          ranks (issuing its collectives), instances, reason (why by order; "" by sequence
                          numbers)}}: how instances are matched across ranks: by the group's own sequence
                          numbers (`Seq` of newer PyTorch) where every member records them, else by issue
                          order within each step (cross_rank/matching.py). Matched by sequence numbers, an
                          instance's ordinal (stragglers, bandwidth) is the group's sequence number
        stragglers        {by_step_time[] {rank, mean_step_ms, vs_median_pct}, slowest_rank,
                          collective_source, matched_collectives, unmatched_collectives, min_lateness_us,
                          by_wait[] {rank, collectives, times_last, last_pct, caused_wait_us,
                          median_lateness_us, median_extra_compute_us, waited_us, score, significance},
                          waited_for_rank, waited_for_median_us, consistent, significance {rank, steps, ranks,
                          lateness_vs_peers_us, spread_us, spread_source, degrees_of_freedom, t, needed_t,
                          stands_out, confidence} (whether the lateness of the rank causing the most waiting
                          stands out from the step-to-step spread; a straggler is named only then),
                          by_step[] {step, collectives, most_often_last, max_lateness_us, total_wait_us,
                          wait_by_rank_us {rank: us}},
                          worst_instances[] {step, name, ordinal, participants, last_rank, lateness_us,
                          extra_compute_us, arrival_spread_us, end_spread_us},
                          detail_ranks[], details[] {step, name, ordinal, arrival_us[], wait_us[],
                          interval_compute_us[], first_start_us} (per rank in detail_ranks order; only up to
                          50,000 ranks x instances), verdict}; an instance's name carries its
                          process group when the trace names it ("nccl:AllReduce [mesh_tp pg 3]"),
                          and a null arrival/wait marks a rank outside that group
        causes            {findings[] {rank, cause ("work imbalance" | "slow device" | "host-side delay" |
                          "network" | "clock uncertainty" | "unexplained"), explained_share, cause_shares
                          {cause: share}, classified_lateness_us, wait_share,
                          late_instances, median_lateness_us, mean_lateness_us, mean_extra_compute_us,
                          mean_extra_idle_us, mean_carried_us, op_duration_ratio (its time in the kernel launches
                          its peers also ran over theirs: same names, up to the peers' launch count), ops_compared,
                          same_kernel_excess_us (its time in those launches minus the peers'), extra_kernel_us
                          (its time in launches beyond the peers' counts), extra_kernels[] ("name (+N launches,
                          T ms)": the largest of them), expected_slowdown_us, concentrated_kernels[] ("name
                          (Rx, +T ms)": where the same kernels' slow-down sits in a few of them, causes.py),
                          clock_uncertainty_us, phase, phase_vs_peers_pct, data_loader_excess_ms, what_if[] {step, step_time_ms,
                          caused_wait_ms (the waiting it caused, measured: clamped to the step less floor_ms),
                          projected_step_ms (quantities.py "what-if": on basis "replayed", the step less what
                          replaying it through its dependency model saves with this rank's compute at its peers'
                          lower median; on
                          "arithmetic", step_time_ms - caused_wait_ms; within [floor_ms, step_time_ms]), floor_ms
                          (what its peers computed between the step's collectives: no what-if goes below it),
                          basis ("replayed" | "arithmetic"), not_replayed (why an arithmetic step was not
                          replayed: pipeline sends/receives, ranks that issued different collectives)}, routing ("uneven routing: expert E (layer L) on
                          rank R" where the MoE section names a hot expert the rank holds; "" otherwise),
                          explanation, significance (as in stragglers), has_gpu, host_peers[] (the window's
                          other ranks on its host)}}: why each rank causing >= 20% of the waiting whose
                          lateness stands out is late, and its steps if it were on time (causes.py)
        critical_path     {steps[] {step, length_us, span_us (the step across ranks: the earliest rank's
                          start to the latest end; length_us <= span_us), start_ns (the path's start on the clock the merge
                          draws with: epoch ns, less the window's clock offsets), segments[] {kind ("compute" | "host gap" |
                          "data movement" | "work"), rank, collective, start_us (after the
                          path's start), duration_us, share}}, by_rank[] {rank, kind, duration_us, share}}:
                          the chain across ranks that set each step's end (critical_path.py)
        ideal_replay      {steps[] {step, start_ns (the critical path's), measured_ms, ideal_ms (the step replayed
                          with every rank's compute at the ranks' lower median), ops[] {rank, kind ("compute" |
                          "collective": its transfer once every rank arrived), name, start_us, end_us (after the
                          step's start)}}, skipped[]} | null: the ideal step the merged trace draws beside the
                          recorded one (whatif/ideal_steps.py)
        hta               {status: ok|partial|skipped|failed, reason, tables {name: rows[]},
                          errors {analysis: message}, not_applicable {analysis: why}}; tables (HTA's
                          columns and units): temporal_breakdown, idle_time_breakdown,
                          idle_interval_stats, comm_comp_overlap, kernel_type_breakdown,
                          kernel_breakdown, cuda_launch_stats (per rank summary), potential_stragglers;
                          oracle {table: {max_abs_diff, within_tolerance, tolerance} or {error,
                          within_tolerance, oracle_failed (true where only stock HTA failed: not a
                          difference)}}: only with --hta-oracle (stock HTA's analyzers beside)
        bandwidth         {status ("ok" | "not recorded" | "not matched" | "one rank, lower bound": one rank's
                          trace, rows and instances of apparent bandwidth over whole durations, waiting
                          included, a row's algbw/busbw its best instance's, wait_us 0, scope assumed from the
                          group size; bandwidth.py), reason, peak_busbw_gbps {scope: GB/s},
                          peak_source, instances_with_bytes, instances_without_bytes,
                          rows[] {collective, group, bucket_min_bytes, bucket_max_bytes, size_bucket,
                          members, scope ("intra-node" | "inter-node"), instances, total_bytes,
                          moving_us (data movement: own end - last arrival, median over members,
                          summed over instances), wait_us (last arrival - own arrival, mean over
                          members, summed), wait_pct (wait / (wait + moving)), algbw_gbps
                          (total_bytes / moving time, 1e9 B/s), busbw_gbps (algbw x nccl-tests
                          factor), peak_busbw_gbps, peak_pct, verdict, split_status {source: instances}
                          (all-to-all: where the bytes per peer come from: "trainer records" (the MoE
                          records, whole), "trace" (In/Out split size args), "even" ("[]"), "split sizes
                          truncated" (the profiler cut the list at 30 entries: none guessed), "not
                          recorded"; an all-to-all instance's bytes are its busiest sender's), max_peer_bytes
                          (most bytes one member sent one peer in one instance), sender_max_over_mean
                          (busiest over mean sender, worst instance), slow (messages >= 1 MiB below 50%
                          of the peak)}, instances[] {step, name, ordinal (the instance key), row (index in
                          rows[]), bytes, members, moving_us, wait_us, algbw_gbps, busbw_gbps, peak_pct}
                          (the first 5,000 timed instances)} | null
        pipeline          PipelineReport | null (no point-to-point traffic): {schedule, stages, microbatches
                          (from the stages' pp_schedule markers; null without), theoretical_bubble_pct
                          ((p-1)/(m+p-1) for gpipe/1f1b, (p-1)/(v m+p-1) interleaved), p2p_source ("gloo
                          spans" | "nccl SendRecv kernels" | "host send/recv ops"), ranks[] {rank, stages[],
                          steps, step_ms, bubble_ms (time in receives per step), bubble_pct (of the step),
                          forward_wait_ms (for activations), backward_wait_ms (for gradients),
                          compute_per_microbatch_ms (pp_forward + pp_backward per micro-batch), sends, recvs},
                          transfers (sends paired with their receive), unpaired, slowest_rank,
                          slowest_stages[], verdict}; sends and receives are never counted as
                          collectives (cross_rank/pipeline.py)
    trainer               TrainerEvidence, from metrics/rank<R>.jsonl and rank<R>.compile.json | null:
                          {status ("ok" | "not recorded"), reason, missing_ranks[], warnings[] (leak
                          suspicion, allocation retries/OOMs, input wait >= 10% of step time, compilation in
                          profiled/traced steps, recompiles, steps after the last profile window > 3% slower),
                          ranks[] {rank, problems[],
                          memory {steps[], allocated_mb[], reserved_mb[] (per-step allocator peaks, MiB),
                          peak_allocated_mb, peak_reserved_mb, fragmentation_mb (reserved - allocated in the
                          step of the reserved peak), fragmentation_pct, alloc_retries, ooms (summed),
                          growth_mb_per_step (least-squares slope after the first 2 steps, >= 4 steps),
                          leak_suspected (slope >= 1 MiB/step)} | null,
                          input {steps, mean_data_ms, max_data_ms, data_pct (data_ms over step_time_ms),
                          basis (steps, mean and share leave out step 0 and the profiled steps),
                          recorded_steps[], data_ms[] (the trainer's data_ms of every step)} | null,
                          profiling {first_profiled_step, last_profiled_step, before, inside, after (each
                          {steps[], median_ms}: steady steps from step 3 before the first window, the profiled
                          steps, the steps after the last window), after_vs_before, inside_vs_before (each
                          {median_pct, low_pct, high_pct}: difference of median step_time_ms, 95% bootstrap
                          interval | null with < 3 steps), excluded} | null (no profiled step)
                          (per_rank/profiling_cost.py; a warning when after is > 3% slower than before),
                          compile {mode, backend, final, compile_time_s, frames_compiled, graphs,
                          graph_break_count, graph_breaks[] {reason, count}, recompiles[] {compile_id,
                          function, reason}, cuda_graphs, cudagraph_skip_reasons[], steps_with_compilations[],
                          compiled_in_timed_steps[]} | null}
    capture               CaptureSection (cross_rank/capture.py, hang.py) | null (no unplanned window, no dump):
                          {windows[] {window, kind ("requested" | "triggered"), steps ("12-13": recorded
                          steps), ranks[] | null (all), why (who asked and when / which trigger, on what value)},
                          problems[],
                          hang {dumped_ranks[], missing_dumps[], detected_by[] {rank, step (steps done),
                          seconds (without progress), at}, dump_reasons {rank: hang | dump_requested | error |
                          stop_signal}, late_ranks[] (never entered the collective others wait in), verdict,
                          groups[] {group, desc, ranks[], members[] {rank, last_entered Call | null,
                          last_completed_seq | null}, waiting_in Call | null, waiting_ranks[], late_ranks[],
                          mismatches[] ("#seq: ranks [..]: signature; ...")}, late_rank_stacks {rank:
                          ["function (file:line)", innermost first]}, last_steps {rank: last step with metrics},
                          last_window, log_tails {rank: lines[]}, pytorch_analysis[] (PyTorch's own matcher),
                          problems[]} | null; Call {seq (collective_seq_id), name, input_sizes, input_dtypes,
                          state, frames[] (recorded stack, innermost first)}

    moe                   MoeReport, the MoE view (cross_rank/moe.py) | null (no MoE ranges or records):
                          {status ("ok" | "not recorded": no metrics/rank<R>.moe.jsonl), reason, ep
                          (expert-parallel degree), num_experts, hot_expert_min_ratio (an expert with at
                          least this many times the mean expert's tokens in a layer is a finding; 1.5),
                          layers[] {layer, record_steps (steps with records), tokens_per_expert[] (token
                          copies routed to each global expert, all ranks summed, mean per step),
                          expert_max_over_mean, hottest_expert, tokens_per_rank {rank: token copies its
                          experts received per step}, rank_max_over_mean (most loaded rank over its ep
                          group's mean, worst group; null with ep 1), split_tokens[src][dst],
                          split_bytes[src][dst] (dispatch sends per step between global ranks, labelled by
                          split_ranks[]), ranks[] {rank, host_ms {kind: ms per profiled step of the
                          moe/<kind>[layer L] host ranges: router, dispatch, split_sizes_d2h, experts,
                          combine}, gpu_ms {kind: GPU range ms per step}, grouped_gemm_ms (GEMM kernels
                          inside moe/experts, GPU ms per step), split_sizes_d2h_ms (the host-synchronizing
                          copy of the all-to-all split sizes, host ms per step, trace),
                          split_sizes_d2h_record_ms (the same from the records, every recorded step),
                          dispatch_wait_ms, dispatch_transfer_ms, combine_wait_ms, combine_transfer_ms
                          (at the layer's forward all-to-alls, per member of its ep group: wait = last
                          member's start - own start, transfer = own end - last member's start; ms per
                          step), combine_last_pct (how often this rank started last at the combine),
                          combine_cost_ms (over those combines, the others' mean wait for it, ms per
                          step), recv_tokens}},
                          findings[] {layer, expert, tokens_vs_mean (x), ep_rank (null: ep 1), ranks[]
                          (global ranks holding the expert: ep rank k holds experts [k E/ep, (k+1) E/ep)),
                          holder_last_pct, cost_ms_per_step (the holders' combine_cost_ms summed), sentence},
                          ep_groups[][] (global ranks of each expert-parallel group, by ep rank; records)
    whole_run             WholeRun, every step of every rank from metrics/rank<R>.timeline (else rank<R>.jsonl)
                          (cross_rank/whole_run.py) | null (neither recorded): {status, reason, sources {source:
                          ranks[]}, ranks, first_step, last_step, steady_steps, step_time_ms, median_rank_step_ms,
                          basis, lateness_basis, slow_ranks[] {rank, from_step, to_step, to_the_end, signal
                          (input wait | late at the first collective | step time), excess_ms, baseline_ms, excess_pct
                          (excess_ms in % of baseline_ms: a size, may exceed 100), job_step_change_ms, steps, last_pct, first_collective_last_pct, median_lateness_ms, windows[], sentence},
                          changes[] {rank, step, level_before, level_after} (changes_total in all; changes_below_size:
                          found, but the level moved by less than 0.01, not listed), windows[]
                          {first_step, last_step, median_ms, between_median_ms, percentile_pct}, drift,
                          representative, step_time_map, lateness_map {quantity, unit, binning, rank_bins[][],
                          step_bins[][], values[][]}, verdict, notes[]}

Definitions of every metric: utilization.py (busy/idle/comm/overlap), stragglers.py (arrival, lateness,
wait, score), causes.py (straggler causes, what-if), bandwidth.py and comm_bytes.py (collective sizes and bandwidth), gpu_time.py (GPU time by
phase, range and category), host_stalls.py (syncs, input waits, idle causes), trainer_records.py (memory,
input, compile records), collectives.py (collective times and keys), moe.py (per_rank: MoE range times; cross_rank: routing, all-to-all waits,
hot experts), pipeline.py and p2p.py (sends,
receives, bubbles, stage compute), clock_align.py (clock offsets),
steps.py (steps and phases), kernels.py (kernel totals).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.analysis.cross_rank.bandwidth import Bandwidth
from fleetscope.analysis.cross_rank.causes import CauseAnalysis
from fleetscope.analysis.cross_rank.capture import CaptureSection
from fleetscope.analysis.cross_rank.clock_align import ClockAlignment
from fleetscope.analysis.cross_rank.critical_path import CriticalPaths
from fleetscope.analysis.whatif.ideal_steps import IdealReplay
from fleetscope.analysis.cross_rank.hta_views import HtaViews
from fleetscope.analysis.cross_rank.matching import CollectiveMatching
from fleetscope.analysis.cross_rank.pipeline import PipelineReport
from fleetscope.analysis.cross_rank.moe import MoeReport
from fleetscope.analysis.cross_rank.records import TrainerEvidence
from fleetscope.analysis.cross_rank.stragglers import Stragglers
from fleetscope.analysis.cross_rank.whole_run import WholeRun
from fleetscope.analysis.inputs.sources import (  # noqa: F401  (part of the report's model)
    SOURCE_RUN_DIR,
    SOURCE_TRACE_DIR,
    SOURCE_TRACE_FILE,
    MissingTrace,
)
from fleetscope.analysis.per_rank.gpu_time import GpuTime
from fleetscope.analysis.per_rank.host_stalls import HostStalls
from fleetscope.analysis.per_rank.kernels import KernelTotal
from fleetscope.analysis.per_rank.step_work import StepWork
from fleetscope.analysis.cross_rank.outcome import JobOutcome
from fleetscope.analysis.per_rank.steps import StepStats, StepTiming
from fleetscope.analysis.per_rank.utilization import Utilization

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
"""Versions from_json reads: version 1 differs only in its what-ifs' basis (all arithmetic)."""




@dataclass(frozen=True, kw_only=True)
class Problem:
    """A trace file that could not be used, or (label "job") the job that did not complete."""

    label: str
    reason: str
    window: int | None = None
    rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """One rank in one window."""

    rank: int
    host: str
    label: str
    rank_source: str
    backend: str | None
    world_size: int | None
    event_count: int
    dropped_events: dict[str, int]
    step_source: str | None
    steps: list[StepTiming]
    step_time: StepStats | None
    utilization: Utilization | None
    collective_source: str | None
    collective_count: int
    gpu_time: GpuTime | None = None
    host_stalls: HostStalls | None = None
    step_work: StepWork | None = None


@dataclass(frozen=True, kw_only=True)
class WindowReport:
    window: int | None
    steps: list[int]
    ranks: list[RankReport]
    clock: ClockAlignment
    stragglers: Stragglers
    top_kernels: list[KernelTotal]
    """Kernels with the most GPU time, summed over the window's ranks (empty for CPU traces)."""
    hta: HtaViews
    gpu_time: GpuTime | None = None
    """GPU time of the window's ranks summed (gpu_time.py)."""
    bandwidth: Bandwidth | None = None
    """Collective bandwidth per (type, group, size bucket), bandwidth.py."""
    pipeline: PipelineReport | None = None
    """Point-to-point transfers, bubble per stage and the slowest stage (cross_rank/pipeline.py)."""
    notes: list[str] = field(default_factory=list)
    causes: CauseAnalysis = field(default_factory=CauseAnalysis)
    """Why each straggler is late (cross_rank/causes.py)."""
    critical_path: CriticalPaths = field(default_factory=CriticalPaths)
    """Per step, the cross-rank chain that determined its end (cross_rank/critical_path.py)."""
    collective_matching: CollectiveMatching = field(default_factory=CollectiveMatching)
    """How the window's collective instances were matched across ranks, per process group
    (cross_rank/matching.py)."""
    ideal_replay: IdealReplay | None = None
    """The critical-path steps replayed with every rank's compute at the ranks' lower median (whatif/ideal_steps.py)."""


@dataclass(frozen=True, kw_only=True)
class RankSummary:
    """One rank over all windows; percentages are weighted by each window's span."""

    rank: int
    host: str
    windows: int
    step_time: StepStats | None
    basis: str | None
    span_us: float
    busy_pct: float | None
    idle_pct: float | None
    comm_pct: float | None
    overlap_pct: float | None


@dataclass(frozen=True, kw_only=True)
class TopFinding:
    """One of the advisor's findings as the report shows it next to the verdict (analysis/advise/)."""

    rule: str
    title: str
    gain: str
    """"expected gain up to X ms/step (P% of S ms, basis)" or "gain not estimated"."""
    change: str
    confidence: str
    ranks: list[int] = field(default_factory=list)
    windows: list[int | None] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class Report:
    schema_version: int = SCHEMA_VERSION
    created_at: str
    source_path: str
    source_kind: str
    world_size: int | None
    complete: bool
    problems: list[Problem] = field(default_factory=list)
    missing: list[MissingTrace] = field(default_factory=list)
    missing_total: int = 0
    notes: list[str] = field(default_factory=list)
    verdict: str = ""
    advice: list[TopFinding] = field(default_factory=list)
    step_time: StepStats | None = None
    step_time_basis: str = ""
    run_step_time_ms: float | None = None
    run_step_time_basis: str = ""
    ranks: list[RankSummary] = field(default_factory=list)
    windows: list[WindowReport] = field(default_factory=list)
    trainer: TrainerEvidence | None = None
    capture: CaptureSection | None = None
    moe: MoeReport | None = None
    whole_run: WholeRun | None = None
    outcome: JobOutcome | None = None

    @property
    def state(self) -> str:
        """What the header says: the job's outcome where it did not complete (FAILED, HUNG, CANCELLED), else
        "complete" or "PARTIAL" (traces missing or unusable)."""
        if self.outcome is not None and not self.outcome.completed:
            return self.outcome.state.upper()
        return "complete" if self.complete else "PARTIAL"

    @property
    def analyzed_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Report":
        version = data.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(f"report schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
        return _build(cls, data)

    @classmethod
    def from_json_lenient(cls, data: Any) -> tuple["Report", list[str]]:
        """The report as far as it parses, and a note per field that did not (lenient_build below): for a
        reader that draws what it can, as the merge does. ValueError when `data` is no JSON object or the
        report itself cannot be built (a top-level number that is not one)."""
        notes: list[str] = []
        version = data.get("schema_version") if isinstance(data, dict) else None
        if isinstance(data, dict) and version not in READABLE_SCHEMA_VERSIONS:
            notes.append(f"schema_version {version!r} is not one this version reads "
                         f"({', '.join(map(str, READABLE_SCHEMA_VERSIONS))}): read what parses")
        try:
            return lenient_build(cls, data, notes), notes
        except UnreadableField as error:
            raise ValueError(str(error)) from None


def _build(cls: type, data: Any, where: str = "") -> Any:
    """A dataclass instance from its asdict() form, following the field type hints. A report.json is
    read back from a run directory anyone may have written: a value of another type than its field's
    raises TypeError naming the field (load_report_json names the file)."""
    if not isinstance(data, dict):
        raise TypeError(f"{where or cls.__name__}: expected an object, got {type(data).__name__}")
    hints = _type_hints(cls)
    values = {}
    for item in dataclasses.fields(cls):
        if item.name in data:
            values[item.name] = _convert(hints[item.name], data[item.name], f"{where}{item.name}")
    return cls(**values)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A dataclass's resolved field types (resolving them is slow, and a report holds many of each)."""
    return typing.get_type_hints(cls)


_SCALARS = {bool: (bool, np.bool_), int: (numbers.Integral,), float: (numbers.Real,), str: (str,)}
"""What a scalar field accepts: its JSON type, or the numpy scalar a report built in memory holds (an
integer stands for a float; a bool is no number)."""


def _convert(hint: Any, value: Any, where: str) -> Any:
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        if len(options) == 1:
            return _convert(options[0], value, where)
        if any(_is_scalar(option, value) for option in options):
            return value
        raise TypeError(f"{where}: {type(value).__name__} is none of {hint}")
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        _require_type(value, list, where)
        return [_convert(item_hint, v, f"{where}[]") for v in value]
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        _require_type(value, dict, where)
        key = int if key_hint is int else (lambda k: k)   # JSON object keys are strings
        return {key(k): _convert(value_hint, v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{where}.")
    if hint in _SCALARS and not _is_scalar(hint, value):
        raise TypeError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def _is_scalar(hint: Any, value: Any) -> bool:
    is_bool = isinstance(value, (bool, np.bool_))
    return isinstance(value, _SCALARS.get(hint, ())) and (hint is bool) == is_bool


def _require_type(value: Any, kind: type, where: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{where}: expected a {kind.__name__}, got {type(value).__name__}")


# --- lenient reading: what parses, and a note for the rest ---------------------------------------------

class UnreadableField(Exception):
    """A value lenient_build cannot use; its message names the field (its path in the report) and why."""


def lenient_build(cls: type, data: Any, notes: list[str], where: str = "") -> Any:
    """A dataclass instance from its asdict() form as far as it parses, for readers that use what they can
    of a report written by another version or by hand. A field that is unreadable takes its default, and
    one that is missing or unreadable without a default its type's empty value (_empty_value); a list item
    or dict entry that cannot be read is left out; each such repair is one line in `notes` (a missing field
    with a default is none: fields added since the report was written have one). UnreadableField when the object itself cannot be
    built: not an object, or a number field (not a flag) without a default is missing or unreadable."""
    if not isinstance(data, dict):
        raise UnreadableField(f"{where.rstrip('.') or cls.__name__}: expected an object, got {type(data).__name__}")
    hints = _type_hints(cls)
    values = {}
    for item in dataclasses.fields(cls):
        path = f"{where}{item.name}"
        if item.name in data:
            try:
                values[item.name] = _lenient_convert(hints[item.name], data[item.name], path, notes)
                continue
            except UnreadableField as error:
                reason = str(error)
        elif _has_default(item):
            continue                              # a field newer than the report: what its default is for
        else:
            reason = f"{path}: missing"
        if _has_default(item):
            notes.append(f"{reason}; left at its default")
            continue
        values[item.name] = _empty_value(hints[item.name], reason)
        shown = "an empty section" if dataclasses.is_dataclass(values[item.name]) else repr(values[item.name])
        notes.append(f"{reason}; read as {shown}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:      # a __post_init__ that refuses the values read
        raise UnreadableField(f"{where.rstrip('.') or cls.__name__}: {error}") from None


def _lenient_convert(hint: Any, value: Any, where: str, notes: list[str]) -> Any:
    origin = typing.get_origin(hint)
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        _require_readable(value, list, where)
        return _lenient_items(item_hint, value, where, notes)
    if origin is dict:
        return _lenient_dict(hint, value, where, notes)
    if dataclasses.is_dataclass(hint):
        return lenient_build(hint, value, notes, f"{where}.")
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1 and value is not None:
            return _lenient_convert(options[0], value, where, notes)
    try:
        return _convert(hint, value, where)
    except (TypeError, ValueError) as error:
        raise UnreadableField(str(error)) from None


def _lenient_items(item_hint: Any, value: list, where: str, notes: list[str]) -> list:
    items = []
    for index, item in enumerate(value):
        try:
            items.append(_lenient_convert(item_hint, item, f"{where}[{index}]", notes))
        except UnreadableField as error:
            notes.append(f"{error}; item left out")
    return items


def _lenient_dict(hint: Any, value: Any, where: str, notes: list[str]) -> dict:
    key_hint, value_hint = typing.get_args(hint)
    _require_readable(value, dict, where)
    entries = {}
    for key, item in value.items():
        try:
            entries[int(key) if key_hint is int else key] = _lenient_convert(value_hint, item, f"{where}.{key}", notes)
        except ValueError:
            notes.append(f"{where}.{key}: not an integer key; entry left out")
        except UnreadableField as error:
            notes.append(f"{error}; entry left out")
    return entries


def _empty_value(hint: Any, reason: str) -> Any:
    """What a field without a default reads as when missing or unreadable: None where it may be None, else an
    empty list, dict, string or section; a flag reads False (not stated, so not set). A number has no such
    value (0 would invent a rank, a step or a count): UnreadableField."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint):
        return None
    if origin is list or hint is list:
        return []
    if origin is dict or hint is dict:
        return {}
    if hint is str:
        return ""
    if hint is bool:
        return False
    if dataclasses.is_dataclass(hint):
        return lenient_build(hint, {}, [])      # an empty section: its own missing fields are no news
    raise UnreadableField(reason)


def _has_default(item: dataclasses.Field) -> bool:
    return item.default is not dataclasses.MISSING or item.default_factory is not dataclasses.MISSING


def _require_readable(value: Any, kind: type, where: str) -> None:
    if not isinstance(value, kind):
        raise UnreadableField(f"{where}: expected a {kind.__name__}, got {type(value).__name__}")
