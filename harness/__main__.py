"""python -m harness, and the `kvharness` console script (pyproject.toml [project.scripts] points
at script here): the command line (harness/cli.py), with Ctrl-C and SIGTERM handled from the first
instruction, before the imports: the first of either is raised where the program is, as
Interrupted (a KeyboardInterrupt that carries the signal), and the CLI exits 128 + the signal's
number, 130 or 143, with one line (a run keeps every stored chunk, its Dask workers stopped with
it: they never see Ctrl-C themselves, harness.distributed.cluster); any later one is ignored
while the program stops, so that no second traceback follows the line. The handlers are
installed when this module is imported, which the console script does before anything else.
Once the command is over and has said so, the process ends without the interpreter's teardown
(script)."""
import atexit
import os
import signal
import sys
import time

_STARTED = time.perf_counter()   # what a run measures its own start-up from (harness.runner._startup_s)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (defined here: the handler may run while harness.errors is importing)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# main has entered the block that turns Interrupted into the one line; before, in a process
# started to run the command line (its main module is __main__: python -m harness, the console
# script), a signal is kept here for main to raise there (raised at the module's own level it
# would be a traceback, exit 1). A process that only imports this module (a worker spawned from
# the console script, whose main module is __mp_main__) never runs main: there it is raised.
_IN_MAIN = False
_DEFERS = getattr(sys.modules.get("__main__"), "__name__", None) == "__main__"
_PENDING: list[int] = []


def _interrupted(signum, frame):
    for each in (signal.SIGINT, signal.SIGTERM):
        signal.signal(each, signal.SIG_IGN)
    if _DEFERS and not _IN_MAIN:
        _PENDING.append(signum)
        return
    raise Interrupted(signum)


def _unraisable(unraisable, report=sys.unraisablehook):
    """sys.unraisablehook: an Interrupted raised where Python cannot propagate an exception (a
    garbage-collector callback, a __del__; Dask installs such a callback) would be reported
    there and lost, the run going on with the signal spent; instead it is raised again at the
    main thread's next instruction. Anything else is reported as before."""
    if isinstance(unraisable.exc_value, Interrupted):
        _raise_later(unraisable.exc_value.signum)
        return
    report(unraisable)


def _raise_later(signum: int) -> None:
    """The signal's handler back, and the signal delivered to the main thread again from another
    thread a moment later, once the hook has returned: raised in the hook it would be lost again
    (a signal tripped in the main thread is handled at once). Where it comes before, it is
    caught and scheduled once more."""
    import _thread
    import threading

    def later():
        time.sleep(0.01)
        _thread.interrupt_main(signum)
    signal.signal(signum, _interrupted)
    try:
        threading.Thread(target=later, daemon=True).start()
    except Interrupted:
        _raise_later(signum)


for _signal in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signal, _interrupted)
sys.unraisablehook = _unraisable


def main() -> int:
    """The command line's exit status (harness.cli.main), 130 or 143 with one line where the
    signal came while the CLI itself was importing. Once the command is over, both signals are
    ignored: whatever ends the process after it (script's exit, or an interpreter's teardown
    where main is called otherwise) must not end it silently, killed, after its command had
    finished and said so."""
    global _IN_MAIN
    try:
        try:
            _IN_MAIN = True
            if _PENDING:   # a signal while this module was still being run
                raise Interrupted(_PENDING[0])
            from . import cli
            cli.STARTED_AT = _STARTED
            return cli.main()
        finally:
            for each in (signal.SIGINT, signal.SIGTERM):
                signal.signal(each, signal.SIG_IGN)
    except KeyboardInterrupt as exc:   # while the CLI itself was being imported, or just as it returned
        print("interrupted", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)


def script() -> None:
    """main's exit status, as the process's: once the command is over, atexit's handlers run and
    the standard streams are flushed, then the process ends without the interpreter's teardown
    (freeing pandas, matplotlib, torch and the rest module by module: about a second, measured on
    harness report at load 0.6 on a 2-core machine), which a command that has written and closed
    everything it writes does not need."""
    code = main()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):   # a closed pipe: nothing more to say there
                pass
        os._exit(code)


if __name__ == "__main__":
    script()
