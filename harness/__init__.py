"""kvharness orchestration: the CLI (python -m harness), sweeps, the runner and the run store."""
import os

# Idle OpenMP threads sleep instead of spinning. libgomp reads this once, when torch loads it, so
# it is set here, before anything of the harness imports torch (the CLI's modules do, on import):
# with more runnable threads than cores — a loaded machine, or Dask workers beside each other —
# spinning cost a serial run up to 4x (95 s against 20 s for the same rows), and on a busy 2-CPU
# machine a torch matmul after the compiled loops 10x. A value set by the user is kept; a program
# that loaded torch before importing the harness keeps torch's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
