"""User-facing errors: one line, exit code 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (file, flag, data). Printed as one line; the process exits with 2."""

    exit_code = 2
