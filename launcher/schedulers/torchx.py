"""Slurm through TorchX: an AppDef like `dist.ddp` (one torchrun per node, c10d rendezvous on the first node),
materialized by TorchX's own Slurm request into a heterogeneous batch job (one component per node).

`plan_torchx` is pure. TorchX's `SlurmScheduler._submit_dryrun` asks `sinfo` for the partition's memory, so
the plan builds TorchX's `SlurmBatchRequest` from its `SlurmReplicaRequest.from_role` directly and adds what
TorchX 0.7 has no option for (account, qos, extra sbatch options, quoted). `submit_torchx` writes TorchX's
materialized script into the run's logs and runs `sbatch --parsable --chdir=<logs>` on it: TorchX's own
`schedule` would write its bookkeeping file and the per-node logs into the caller's working directory.
The job is still TorchX's: `torchx status slurm://fleetscope/<job id>` works (with Slurm accounting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...trainer.config import ConfigError
from ...traces.jobfile import now_iso, write_job_record
from ...traces.layout import RunLayout, torchx_local_logs_dir, torchx_node_logs_dir
from ..failures import RankFailure, collect_failures, summary_failures
from ..scheduler import Submission
from ..slurm_request import (
    PostprocessJob,
    SlurmResources,
    export_lines,
    plan_postprocess_job,
    render_postprocess,
    safe_job_label,
    slurm_logs_dir,
)
from ..spec import JobSpec, spec_record
from .local import RecordedRunStatus, report_program_traces
from .slurm import SlurmScheduler, SubmittedSlurmJob, submit_batch_script, submit_postprocess

COLLECT_MODULE = "fleetscope.cli.main"
"""`python -m fleetscope.cli.main collect-traces RUN_DIR GLOB`, run on each node after its torchrun."""
RDZV_PORT = 29500
SESSION_NAME = "fleetscope"
SCRIPT_NAME = "torchx-sbatch.sh"


def torchrun_command(spec: JobSpec, *, rank0_host: str, rdzv_id: str, replica: str) -> list[str]:
    """torchrun for one node, as `dist.ddp` writes it; `rank0_host`, `rdzv_id`, `replica` may be shell text."""
    layout = RunLayout.at(spec.train.run_dir)
    return [
        spec.python, "-m", "torch.distributed.run",
        "--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.nproc_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rank0_host}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
        "--log-dir", str(torchx_node_logs_dir(layout, replica)),
        "--redirects", "3", "--tee", "3",
        *spec.rank_program(),
    ]


def node_script(spec: JobSpec) -> str:
    """The `bash -c` text each node runs: the environment, then torchrun (exec: signals reach it directly).

    The rendezvous host, id and the replica number are TorchX macros (`${rank0_env}`, `${app_id}`,
    `${replica_id}`), filled per scheduler and replica. They are put in after quoting, in place of sentinels
    that quoting leaves intact.
    """
    from torchx.specs import macros

    sentinels = {"@rank0_host@": f'"${{{macros.rank0_env}:=localhost}}"', "@rdzv_id@": macros.app_id,
                 "@replica@": macros.replica_id}
    command = " ".join(shlex.quote(arg) for arg in torchrun_command(
        spec, rank0_host="@rank0_host@", rdzv_id="@rdzv_id@", replica="@replica@"))
    for sentinel, text in sentinels.items():
        command = command.replace(sentinel, text)
    environment = export_lines(spec.rank_environment())
    entry = spec.entry
    if entry is None:
        return "\n".join([*environment, f"exec {command}"])
    workdir = f"cd -- {shlex.quote(entry.workdir)}"
    if not entry.collect_glob:
        return "\n".join([*environment, workdir, f"exec {command}"])
    # Not exec: once torchrun is over (any outcome), this node files the traces on its own disk.
    collect = " ".join(shlex.quote(arg) for arg in [spec.python, "-m", COLLECT_MODULE, "collect-traces",
                                                    str(RunLayout.at(spec.train.run_dir).root), entry.collect_glob])
    return "\n".join([*environment, workdir, command, "status=$?", f"{collect} || true", 'exit "$status"'])


def mem_megabytes(text: str) -> int:
    """'200G' / '4096M' / '8000' (Slurm's MB default) as megabytes; '' -> 0 (no memory request)."""
    if not text:
        return 0
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    if text[-1] in units:
        return max(1, int(int(text[:-1]) * units[text[-1]]))
    return int(text)


def build_appdef(spec: JobSpec, resources: SlurmResources) -> Any:
    """One role, one replica per node, each running torchrun for its node's ranks."""
    from torchx import specs

    cpus = resources.cpus_per_task * resources.nproc_per_node  # 0: no request, the cluster default
    role = specs.Role(
        name=safe_job_label(resources.job_name),
        image="",
        entrypoint="bash",
        args=["-c", node_script(spec)],
        num_replicas=resources.nodes,
        resource=specs.Resource(cpu=cpus, gpu=resources.gpus_per_node, memMB=mem_megabytes(resources.mem_per_node)),
        port_map={"c10d": RDZV_PORT},
        max_retries=0,
    )
    return specs.AppDef(name=safe_job_label(resources.job_name), roles=[role])


def scheduler_config(resources: SlurmResources) -> dict[str, str]:
    config = {"time": str(resources.time_minutes)}
    if resources.partition:
        config["partition"] = resources.partition
    return config


def slurm_batch_request(app: Any, resources: SlurmResources, logs_dir: str) -> Any:
    """TorchX's SlurmBatchRequest for `app`, built as TorchX's dry run builds it, without asking sinfo."""
    from torchx.schedulers.slurm_scheduler import SlurmBatchRequest, SlurmReplicaRequest
    from torchx.specs import macros

    config = scheduler_config(resources)
    replicas = {}
    for role in app.roles:
        for replica_id in range(role.num_replicas):
            values = macros.Values(img_root=role.image, app_id=macros.app_id, replica_id=str(replica_id),
                                   rank0_env="SLURM_JOB_NODELIST_HET_GROUP_0")
            name = f"{role.name}-{replica_id}"
            replica = SlurmReplicaRequest.from_role(name, values.apply(role), config,
                                                    nomem=not resources.mem_per_node)
            replica.sbatch_opts.update(extra_group_options(resources))
            replicas[name] = replica
    return SlurmBatchRequest(cmd=["sbatch", "--parsable", f"--chdir={logs_dir}"], replicas=replicas, job_dir=None,
                             max_retries=min(role.max_retries for role in app.roles))


def extra_group_options(resources: SlurmResources) -> dict[str, str | None]:
    """Per-component options TorchX has no setting for; values quoted (TorchX writes them verbatim)."""
    options: dict[str, str | None] = {}
    if resources.account:
        options["account"] = resources.account
    if resources.qos:
        options["qos"] = resources.qos
    for option in resources.extra:
        options[option.key] = None if option.value is None else shlex.quote(option.value)
    return options


@dataclass(frozen=True, kw_only=True)
class TorchXPlan:
    spec: JobSpec
    app: Any
    """The TorchX AppDef."""
    request: Any
    """TorchX's SlurmBatchRequest; `request.materialize()` is the batch script."""
    sbatch_script: str
    script_path: str
    postprocess: PostprocessJob | None
    """The gather/analyze/merge job submitted after the training job; None: none (--no-post)."""
    run_dir: Path
    config: dict[str, str] = field(default_factory=dict)

    @property
    def sbatch_argv(self) -> list[str]:
        return [*self.request.cmd, self.script_path]

    def render(self) -> str:
        return "\n".join([
            f"# torchx (slurm): {' '.join(shlex.quote(arg) for arg in self.sbatch_argv)}, whose text is:",
            self.sbatch_script,
            *render_postprocess(self.postprocess),
        ])

    def to_json(self) -> dict[str, Any]:
        return {"kind": "torchx", "scheduler": "slurm", "sbatch_argv": self.sbatch_argv,
                "sbatch_script": self.sbatch_script,
                "postprocess_script": self.postprocess.script if self.postprocess else None}


def plan_torchx(spec: JobSpec, *, postprocess: bool = True) -> TorchXPlan:
    resources = SlurmResources.from_spec(spec)
    logs_dir = slurm_logs_dir(spec)
    app = build_appdef(spec, resources)
    request = slurm_batch_request(app, resources, logs_dir)
    return TorchXPlan(spec=spec, app=app, request=request, sbatch_script=request.materialize(),
                      script_path=str(Path(logs_dir) / SCRIPT_NAME),
                      postprocess=plan_postprocess_job(spec, resources) if postprocess else None,
                      run_dir=RunLayout.at(spec.train.run_dir).root, config=scheduler_config(resources))


def submit_torchx(plan: TorchXPlan) -> SubmittedSlurmJob:
    """Write TorchX's script into the run's logs, sbatch it, then submit the post-processing job."""
    script = Path(plan.script_path)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(plan.sbatch_script)
    job_id = submit_batch_script(plan.sbatch_argv)
    postprocess_id = submit_postprocess(plan.postprocess, job_id, script.parent) if plan.postprocess else ""
    return SubmittedSlurmJob(job_id=job_id, postprocess_job_id=postprocess_id, script_path=str(script))


def app_handle(job_id: str) -> str:
    """The TorchX handle of a submitted job (`torchx status <handle>`)."""
    return f"slurm://{SESSION_NAME}/{job_id}"


@dataclass(frozen=True, kw_only=True)
class TorchXLocalPlan:
    """The same AppDef on TorchX's `local_cwd` scheduler: every replica ("node") is a local torchrun."""

    spec: JobSpec
    app: Any
    dryrun_info: Any
    """TorchX's AppDryRunInfo (its request: the processes local_cwd starts)."""
    run_dir: Path

    def render(self) -> str:
        """What TorchX starts, one shell line per replica (paste-able), under a header with its app id."""
        request = self.dryrun_info.request
        header = (f"# torchx (local_cwd): app {request.app_id}, also the rendezvous id (a launch draws a new one); "
                  f"TorchX's logs in {request.log_dir}, the ranks' in "
                  f"{torchx_node_logs_dir(RunLayout.at(self.run_dir), '<replica>')}; it starts, per replica:")
        return "\n".join([header, *(replica_command(replica) for replicas in request.role_params.values()
                                    for replica in replicas)])

    def to_json(self) -> dict[str, Any]:
        return {"kind": "torchx_local", "command": self.render()}


def replica_command(replica: Any) -> str:
    """One local_cwd replica (TorchX's ReplicaParam) as a shell line: its directory, the variables TorchX adds
    (PATH in front of the caller's, as local_cwd joins them), its argv; every value quoted."""
    env = dict(replica.env)
    path = env.pop("PATH", "")
    assignments = [f'PATH={shlex.quote(path)}:"$PATH"'] if path else []
    assignments += [f"{name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    command = " ".join([*assignments, *(shlex.quote(arg) for arg in replica.args)])
    return f"cd -- {shlex.quote(replica.cwd)} && {command}" if replica.cwd else command


def plan_torchx_local(spec: JobSpec) -> TorchXLocalPlan:
    """TorchX's dry run for local_cwd (it writes nothing and starts nothing)."""
    from torchx.runner import get_runner

    # No GPUs in the request: local_cwd assigns none to its one replica (torchrun's ranks see this host's GPUs),
    # and a GPU request would only print TorchX's warning about replicas sharing GPUs, on CPU jobs too.
    resources = dataclasses.replace(SlurmResources.from_spec(spec), gpus_per_node=0)
    layout = RunLayout.at(spec.train.run_dir)
    app = dataclasses.replace(build_appdef(spec, resources), name=safe_job_label(layout.root.name))  # app id: run's
    with _own_stop_signals(), get_runner() as runner:
        info = runner.dryrun(app, "local_cwd", cfg={"log_dir": str(torchx_local_logs_dir(layout))})
    return TorchXLocalPlan(spec=spec, app=app, dryrun_info=info, run_dir=layout.root)


def run_torchx_local(plan: TorchXLocalPlan, *, wait_interval_s: float = 1.0) -> Any:
    """Start the planned processes with TorchX and wait for them; returns TorchX's final AppStatus."""
    from torchx.runner import get_runner

    plan.run_dir.mkdir(parents=True, exist_ok=True)
    with _own_stop_signals(), get_runner() as runner:
        handle = runner.schedule(plan.dryrun_info)
        return runner.wait(handle, wait_interval=wait_interval_s)


@contextlib.contextmanager
def _own_stop_signals():
    """TorchX's local scheduler installs its own SIGTERM and SIGINT handlers in the process that creates it (they
    raise, to stop its replicas): keep them for the run it starts, and give the caller's back afterwards, so a
    dry run changes nothing and the postprocess after a run (HTA's process pool) runs with the program's own."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class TorchXScheduler(SlurmScheduler):
    """TorchX's AppDef on Slurm."""

    name = "torchx"

    def plan(self, spec: JobSpec, *, postprocess: bool = True) -> TorchXPlan:
        return plan_torchx(spec, postprocess=postprocess)

    def submit_training(self, plan: TorchXPlan) -> SubmittedSlurmJob:
        return submit_torchx(plan)

    def app_fields(self, submitted: SubmittedSlurmJob) -> dict[str, Any]:
        return {"torchx_app_handle": app_handle(submitted.job_id)}


class TorchXLocalScheduler:
    """TorchX's local_cwd scheduler: the Slurm path's AppDef, run in the foreground on this node."""

    name = "torchx_local"

    def plan(self, spec: JobSpec, *, postprocess: bool = True) -> TorchXLocalPlan:
        return plan_torchx_local(spec)

    def submit(self, plan: TorchXLocalPlan, layout: RunLayout) -> Submission:
        from torchx.specs import AppState

        layout.root.mkdir(parents=True, exist_ok=True)
        write_job_record(layout, **spec_record(plan.spec), plan=plan.to_json(), status="running",
                         started_at=now_iso())
        status = run_torchx_local(plan)
        if not plan.spec.entry or not plan.spec.entry.collect_glob:  # the node script collected what it names
            report_program_traces(plan.spec, layout)
        succeeded = status is not None and status.state == AppState.SUCCEEDED
        write_job_record(layout, status="succeeded" if succeeded else "failed", finished_at=now_iso(),
                         torchx_state=str(status.state if status else None))
        return Submission(scheduler=self.name, finished=True, succeeded=succeeded,
                          failures=[] if succeeded else local_failures(layout),
                          detail=f"TorchX state {status.state if status else 'unknown'}")

    def status(self, layout: RunLayout) -> RecordedRunStatus:
        return RecordedRunStatus.read(layout, failures=local_failures(layout))


def local_failures(layout: RunLayout) -> list[RankFailure]:
    """Failed ranks of a local_cwd run: its one "node" is replica 0, whose local ranks are the global ranks.
    Ranks that wrote no error file (a program without torch's @record) are named from torchrun's failure
    summary in the stderr.log TorchX keeps, as the local scheduler does from its own copy."""
    return (collect_failures(torchx_node_logs_dir(layout, "0"))
            or summary_failures(sorted(torchx_local_logs_dir(layout).glob("**/stderr.log"))))

    def cancel(self, layout: RunLayout, *, postprocess_too: bool = False) -> list[str]:
        raise ConfigError(f"{layout.root}: a {self.name} run ends with the launch command (Ctrl-C); nothing to cancel")
