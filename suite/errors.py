"""Errors the command line turns into one clear line and an exit code."""

from __future__ import annotations

__all__ = ["UsageError", "EXIT_USAGE"]

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input from the user (a flag, a file, a line in a file). Printed as one line; exit code 2.

    The message should name the input (file and line, record or field) and what is wrong with it.
    """
