"""The one exception type for mistakes a user can fix (bad recipe, data, paths)."""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input. The CLI prints ``problems`` and exits 2, without a traceback."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class NonFiniteError(RuntimeError):
    """Training produced NaN or Inf; the run stops without writing anything non-finite (exit 1)."""
