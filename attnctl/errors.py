"""The one error type attnctl raises on purpose.

Everything below ``cli`` raises :class:`AttnctlError`; ``cli`` turns it into a
single line on stderr and an exit code. Usage errors (bad options, bad files)
exit 2; failures while running (out of memory) exit 1.
"""

from __future__ import annotations

USAGE = 2
RUNTIME = 1


class AttnctlError(Exception):
    """A problem the user can act on, with the exit code it deserves."""

    def __init__(self, message: str, *, exit_code: int = USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
