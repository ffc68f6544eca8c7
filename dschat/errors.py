"""User-facing errors: one line, exit code 2, no traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (file, flag, data). Printed as one line; the process exits with 2."""

    exit_code = 2


def first_line(error: BaseException | str, limit: int = 200) -> str:
    """The first non-blank line of an exception's message, cut to ``limit`` characters; the exception's type name
    when the message is empty. The one way dschat quotes an error inside its own one-line messages."""
    text = str(error).strip()
    if not text:
        return type(error).__name__ if isinstance(error, BaseException) else ""
    return text.splitlines()[0][:limit]
