"""Errors the command line turns into one clear line and an exit code.

`UsageError` is the project's one `InputError` (defined at the bottom, in `utils.errors`, so that
`diffusion` and `fastfold` raise it without importing the CLI); the name stays for the CLI's own code.
"""

from __future__ import annotations

from ..utils.errors import EXIT_USAGE, InputError, missing_extra

__all__ = ["EXIT_USAGE", "InputError", "UsageError", "missing_extra"]

UsageError = InputError
"""Bad input from the user (a flag, a file, a line in a file). Printed as one line; exit code 2.

The message should name the input (file and line, record or field) and what is wrong with it."""
