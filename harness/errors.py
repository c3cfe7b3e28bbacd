"""Errors the CLI turns into exit statuses."""


class UsageError(Exception):
    """A user error: printed as one line naming what is wrong and what is valid; exit status 2."""

