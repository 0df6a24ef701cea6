"""User-facing errors: the CLI prints their message on one line and exits with code 2."""


class SkipKVError(ValueError):
    """A bad input or an unsupported request, explained in one line."""
