"""kvharness orchestration: the CLI (python -m harness), sweeps, the runner and the run store."""
