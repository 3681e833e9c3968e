"""What-if by simulation: a step's dependency model (model, pipeline_model), its replay with chosen op times
(simulate) and the slowdowns and characterisations computed from replays (metrics)."""
