"""How ``bench train`` reports a configuration that failed: the error, and the line that says why."""

from __future__ import annotations

__all__ = ["BenchFailed", "failure_reason"]


class BenchFailed(RuntimeError):
    """A configuration run failed; the message names it and holds its output.

    Attributes:
        reason: one line saying why (the last error line of the output, else the exit code).
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def failure_reason(lines: list[str], code: int) -> str:
    """The line of a failed run's output that says why: the last that names an error or an
    exception (``RuntimeError: ...``, ``ValueError: ...``), else the exit code.

    Example:
        >>> failure_reason(["Traceback ...", "  x()", "RuntimeError: boom", "exit"], 1)
        'RuntimeError: boom'
    """
    for line in reversed(lines):
        text = line.strip()
        if text and ("Error" in text.split(":")[0] or "Exception" in text.split(":")[0]):
            return text
    return f"exit code {code}"
