"""Installing fleetscope into a user's existing training environment changes nothing they already have.

A throwaway venv is set up as a user's might be: the CPU wheel of torch 2.13, an older transformers 5
(5.20) and urllib3 2. `pip install --dry-run --report` of the project must install neither another torch nor
another transformers nor urllib3 (TorchX 0.7 would downgrade it to 1.26: it lives in the `[slurm]` extra);
then the project is installed for real and imported, its launcher plans a user's script, and tensor
parallel on transformers 5.20 stops with a message naming the version it needs (or runs, where 5.20 has
the API). Network: PyPI for transformers and the project's light dependencies (torch from this disk).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e_packaging import _clean_copy

pytestmark = pytest.mark.slow
USER_ENVIRONMENT = ["torch==2.13.0", "transformers==5.20.0", "urllib3>=2,<3"]
KEPT = ("torch", "transformers", "urllib3")


def pip(venv: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    completed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *args],
                               capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed


def installed_versions(venv: Path) -> dict[str, str]:
    listed = json.loads(pip(venv, "list", "--format=json").stdout)
    return {row["name"].lower(): row["version"] for row in listed}


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("user-env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # --no-compile: the user's environment is the packages, not their bytecode (compiling torch's and
    # transformers' thousands of modules was most of this setup on 2 cores)
    pip(venv, "install", "-q", "--no-compile", *USER_ENVIRONMENT)
    return venv


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return _clean_copy(tmp_path_factory.mktemp("src"))  # builds write egg-info next to the sources


def test_pip_would_change_neither_torch_nor_transformers(user_venv, source, tmp_path):
    before = installed_versions(user_venv)
    report = tmp_path / "report.json"
    pip(user_venv, "install", "--dry-run", "--report", str(report), str(source))
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert "fleetscope" in planned
    assert not set(planned) & set(KEPT), {name: (before.get(name), planned[name]) for name in KEPT if name in planned}
    assert not set(planned) & {"jupyterlab", "pytest", "torchx", "submitit"}  # extras stay out by default


def test_installed_it_imports_plans_a_user_script_and_gates_tensor_parallel(user_venv, source, tmp_path):
    before = installed_versions(user_venv)
    pip(user_venv, "install", "-q", "--no-compile", str(source))
    after = installed_versions(user_venv)
    assert {name: after[name] for name in KEPT} == {name: before[name] for name in KEPT}
    python = str(user_venv / "bin" / "python")
    script = tmp_path / "train.py"
    script.write_text("from fleetscope.trainer import user_profiling as fs\nfs.windows()\n")
    planned = subprocess.run([str(user_venv / "bin" / "fleetscope"), "launch", "--dry-run", "--run-dir",
                              str(tmp_path / "run"), "--", "python", str(script), "--lr", "1"],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.splitlines()[0].endswith(f"{script} --lr 1")
    ran = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ran.returncode == 0 and "not launched by `fleetscope launch`" in ran.stderr, ran.stderr
    slurm = subprocess.run([str(user_venv / "bin" / "fleetscope"), "launch", "--dry-run", "--scheduler", "submitit",
                            "--nproc-per-node", "8", "--run-dir", str(tmp_path / "run"), "--", "python", str(script)],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert slurm.returncode == 2 and "fleetscope[slurm]" in slurm.stderr, slurm.stderr
    probe = ("from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM\n"
             "from fleetscope.trainer.config import ConfigError\n"
             "from fleetscope.trainer.tp_plan import tensor_parallel_plan\n"
             "config = Qwen3MoeConfig(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_experts=2,\n"
             "    num_experts_per_tok=1, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,\n"
             "    head_dim=8, vocab_size=32)\n"
             "try:\n"
             "    tensor_parallel_plan(Qwen3MoeForCausalLM(config))\n"
             "except ConfigError as error:\n"
             "    print(error)\n")
    gate = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert gate.returncode == 0, gate.stderr[-3000:]
    assert "tensor parallel needs transformers >= 5.24; this environment has 5.20.0" in gate.stdout, gate.stdout
