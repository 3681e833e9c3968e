"""A real local Slurm cluster for the tests marked `@pytest.mark.slurm`.

`slurm/cluster/start` brings up munged, MariaDB + slurmdbd, slurmctld and two slurmd daemons (nodes n1, n2,
two fake GPUs each) on loopback; `slurm/cluster/stop` stops exactly those daemons. The session fixture
`slurm_cluster` starts it once per test session and stops it at the end.

Where the cluster cannot run (not root, no apt-get and no Slurm, daemons that fail to start) the Slurm tests
are skipped with the reason, except when FLEETSCOPE_REQUIRE_SLURM=1 (set by .ci/run): then they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
START_SCRIPT = REPO_ROOT / "slurm" / "cluster" / "start"
STOP_SCRIPT = REPO_ROOT / "slurm" / "cluster" / "stop"
REQUIRE_ENV = "FLEETSCOPE_REQUIRE_SLURM"
PORTS_PER_CLUSTER = 16
FIRST_PORT_BASE = 16800
START_TIMEOUT_S = 300


@dataclass(frozen=True)
class SlurmCluster:
    """What a test needs to use the running cluster."""

    state_dir: Path
    partition: str
    nodes: tuple[str, ...]
    gpus_per_node: int
    env: dict[str, str]
    """Variables to add to a client's environment (SLURM_CONF)."""
    start_seconds: float

    @property
    def slurm_conf(self) -> Path:
        return Path(self.env["SLURM_CONF"])

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (squeue, sacct, scontrol ...) against this cluster."""
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                              check=check, timeout=60)

    def log_tail(self, lines: int = 40) -> str:
        """The end of every daemon log: what a failing test should show."""
        parts = []
        for log in sorted((self.state_dir / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)


class ClusterUnavailable(RuntimeError):
    """The cluster cannot run here; the message says why."""


def slurm_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def why_cluster_cannot_run() -> str | None:
    """A reason the cluster cannot run on this machine, or None when it may."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "the local Slurm cluster needs Linux"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (packages, /etc/hosts, mknod, daemons as SlurmUser=root)"
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it"
    return None


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_base(first: int = FIRST_PORT_BASE, attempts: int = 40) -> int:
    """A port base whose whole block is free, so a second cluster (another session) never collides."""
    for base in range(first, first + attempts * PORTS_PER_CLUSTER, PORTS_PER_CLUSTER):
        if all(_port_is_free(base + offset) for offset in range(PORTS_PER_CLUSTER)):
            return base
    raise ClusterUnavailable(f"no block of {PORTS_PER_CLUSTER} free loopback ports from {first}")


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip():
            env[name.strip()] = value
    return env


def start_cluster(state_dir: Path) -> SlurmCluster:
    """Run slurm/cluster/start into `state_dir`; raise ClusterUnavailable with its output on failure."""
    reason = why_cluster_cannot_run()
    if reason is not None:
        raise ClusterUnavailable(reason)
    env = {**os.environ, "FLEETSCOPE_SLURM_PORT_BASE": str(free_port_base())}
    started = time.monotonic()
    try:
        completed = subprocess.run([str(START_SCRIPT), str(state_dir)], env=env, capture_output=True, text=True,
                                   timeout=START_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as error:
        stop_cluster(state_dir)
        raise ClusterUnavailable(f"slurm/cluster/start did not finish in {START_TIMEOUT_S}s") from error
    seconds = time.monotonic() - started
    if completed.returncode != 0:
        stop_cluster(state_dir)
        raise ClusterUnavailable(
            f"slurm/cluster/start failed (exit {completed.returncode}):\n{completed.stdout}{completed.stderr}"
        )
    values = read_env_file(state_dir / "env")
    return SlurmCluster(
        state_dir=state_dir,
        partition=values["FLEETSCOPE_SLURM_PARTITION"],
        nodes=tuple(values["FLEETSCOPE_SLURM_NODES"].split(",")),
        gpus_per_node=int(values["FLEETSCOPE_SLURM_GPUS_PER_NODE"]),
        env={"SLURM_CONF": values["SLURM_CONF"]},
        start_seconds=seconds,
    )


def stop_cluster(state_dir: Path) -> None:
    subprocess.run([str(STOP_SCRIPT), str(state_dir)], check=False, timeout=120)


def skip_or_fail(reason: str) -> None:
    """Skip, or fail where the Slurm tier is required (CI)."""
    if slurm_required():
        pytest.fail(f"{REQUIRE_ENV} is set but the Slurm cluster is unavailable: {reason}", pytrace=False)
    pytest.skip(f"no local Slurm cluster: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The running cluster; SLURM_CONF points at it for the whole session (sbatch, submitit, torchx)."""
    state_dir = tmp_path_factory.mktemp("slurm-cluster")
    try:
        cluster = start_cluster(state_dir)
    except ClusterUnavailable as error:
        skip_or_fail(str(error))
        return
    with pytest.MonkeyPatch.context() as patch:
        for name, value in cluster.env.items():
            patch.setenv(name, value)
        try:
            yield cluster
        finally:
            stop_cluster(state_dir)
