"""Shared fixtures of the test suite."""

import pytest

from slurm_cluster import slurm_cluster  # noqa: F401  (session fixture: a real local Slurm cluster)


@pytest.fixture(autouse=True)
def private_parsed_trace_cache(tmp_path_factory, monkeypatch):
    """Each test analyzes with an empty parsed-trace cache of its own (never the user's ~/.cache), so
    no test sees results another one stored; subprocesses inherit it through the environment."""
    monkeypatch.setenv("FLEETSCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("parsed-trace-cache")))
