"""The one error type the CLI turns into a one-line message."""


class SpecstopError(Exception):
    """A user-facing error: bad input, a missing file, an incompatible model pair."""
