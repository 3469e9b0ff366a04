"""The error `diffusion` raises for bad user input: the project's one `InputError` (the CLI prints it as one
line and exits with code 2)."""

from __future__ import annotations

from ..utils.errors import InputError

__all__ = ["InputError"]
