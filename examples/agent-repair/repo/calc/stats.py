"""Descriptive statistics."""


def mean(xs):
    """The arithmetic mean of a non-empty sequence."""
    if not xs:
        raise ValueError("mean of empty data")
    return sum(xs) / len(xs)


def median(xs):
    """The median of a non-empty sequence."""
    s = sorted(xs)
    return s[len(s) // 2]
