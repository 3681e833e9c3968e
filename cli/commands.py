"""Every sub-command of `fleetscope`, in the order `fleetscope --help` lists them. Each command's module holds
its argument definitions next to its handler (`register(sub)` adds its parser, `handle_*` runs it)."""

from __future__ import annotations

from . import (analyze_command, capture_commands, cause_commands, compare_command, config_command, diff_command,
               fanout_commands, gather_commands, launch_commands, merge_command, postprocess_command, query_command,
               run_commands, split_command, tune_command, whatif_command)

REGISTRY = [
    launch_commands.register_launch, launch_commands.register_train, gather_commands.register_collect,
    gather_commands.register_gather, analyze_command.register_analyze, merge_command.register_merge,
    postprocess_command.register_postprocess, launch_commands.register_demo, compare_command.register_compare,
    query_command.register, capture_commands.register, *fanout_commands.REGISTRY, *run_commands.REGISTRY,
    *cause_commands.REGISTRY, *tune_command.REGISTRY, *config_command.REGISTRY, *diff_command.REGISTRY,
    *whatif_command.REGISTRY, *split_command.REGISTRY,
]
"""The order of the old commands.REGISTRY followed by the other modules' registries, as main.py listed them."""
