"""Per-rank MoE training with scheduled torch.profiler windows (`python -m fleetscope.trainer`)."""
