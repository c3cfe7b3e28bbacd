"""python -m harness: the command line (harness/cli.py), with Ctrl-C and SIGTERM handled from the
first instruction, before the imports: the first of either is raised where the program is, as
Interrupted (a KeyboardInterrupt that carries the signal), and the CLI exits 128 + the signal's
number, 130 or 143, with one line (a run keeps every stored chunk,
its Dask workers stopped with it); any later one is ignored while the program stops, so that no
second traceback follows the line."""
import signal
import sys


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (defined here: the handler may run while harness.errors is importing)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupted(signum, frame):
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)
    raise Interrupted(signum)


for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, _interrupted)

try:
    from .cli import main
    status = main()
except KeyboardInterrupt as exc:   # while the CLI itself was being imported
    print("interrupted", file=sys.stderr)
    status = 128 + getattr(exc, "signum", signal.SIGINT)
sys.exit(status)
