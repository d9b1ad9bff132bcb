class ForerunError(Exception):
    """A user-facing error: the CLI prints it as one line and exits non-zero."""
