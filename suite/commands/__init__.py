"""Subcommand modules of the `suite` CLI: each has `add_arguments(parser)` and `run(args) -> int`."""
