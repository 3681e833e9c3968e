"""Plans and submits jobs: local torchrun, Slurm via submitit or TorchX."""
