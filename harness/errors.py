"""Errors the CLI turns into exit statuses."""


class UsageError(Exception):
    """A user error: printed as one line naming what is wrong and what is valid; exit status 2."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM, raised where the program was (harness/__main__.py's handler):
    the CLI prints one line and exits 128 + the signal's number (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
