"""The one error type the CLI turns into a one-line message."""


class SpecstopError(Exception):
    """A user-facing error: bad input, a missing file, an incompatible model pair."""


def first_line(err: Exception) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
