"""Plans and runs jobs: the spec, the Scheduler interface and what schedulers share (failures, the Slurm
request) here; one module per scheduler (local torchrun, submitit, TorchX, the Slurm client) in schedulers/."""
