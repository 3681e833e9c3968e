"""The `fleetscope` command line: composes launcher, traces and analysis."""
