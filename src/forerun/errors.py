"""The one exception type users see: raised for bad input and unusable models or files."""


class ForerunError(Exception):
    """A user-facing error: the CLI prints it as one line and exits non-zero."""
