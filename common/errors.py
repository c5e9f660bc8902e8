"""User-facing errors: one line that names the problem and the fix."""

from __future__ import annotations


class MemspecError(Exception):
    """An error a user can cause and fix; printed as one line, never a traceback."""

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class ConfigError(MemspecError):
    """The pool config is wrong (bad field, missing path, mismatched tokenizer)."""


class ModelError(MemspecError):
    """A model directory or weight file is missing, corrupt, or incompatible."""


class RequestError(MemspecError):
    """A single request cannot be served (prompt too long, bad sampling params)."""
