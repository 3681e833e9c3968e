"""Shared fixtures of the test suite."""

from slurm_cluster import slurm_cluster  # noqa: F401  (session fixture: a real local Slurm cluster)
