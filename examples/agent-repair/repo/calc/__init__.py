"""A tiny statistics package with a bug in ``median`` (the task of the code-repair example)."""

from calc.stats import mean, median

__all__ = ["mean", "median"]
