"""The error types the CLI turns into a one-line message, and how a library's error is
shortened to fit in it."""


class SpecstopError(Exception):
    """A user-facing error: bad input, a missing file, an incompatible model pair."""


class DataError(SpecstopError, ValueError):
    """A logged-data file that is missing, corrupt or of another schema (a SpecstopError: the
    CLI prints it as one line from any stage)."""


def first_line(err: BaseException) -> str:
    """A library error's message as one short line: its first line (all of its lines where the
    first ends in ':', a list follows), cut to its first sentence where it runs long; its type
    name when it has no message."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = " ".join(lines) if lines[0].endswith(":") else lines[0]
    return text.split(". ")[0] if len(text) > 160 else text
