"""Trace analysis (idle, overlap, stragglers, HTA) and the merged Perfetto trace."""
