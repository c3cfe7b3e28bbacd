"""Dask sweeps: rows identical to a serial run; a worker that dies costs only its chunk."""
import pandas as pd
import pytest

from harness import distributed
from harness.cli import main
from harness.store import RunStore

pytest.importorskip("distributed")

ARGS = ["run", "--scenario", "gaussian,spectral_decay", "--scheme", "tq-kv,plain-kv", "--budget", "2,3",
        "--dim", "16", "--seq-len", "32", "--queries", "4", "--trials", "5", "--quiet"]


def test_distributed_rows_equal_serial_and_survive_a_dead_worker(tmp_path, monkeypatch):
    """--workers 2 (one worker process beside this one) gives the serial rows; so does a cluster
    whose worker dies at its first task (the task is retried: the death costs only its chunk).
    The dead-worker half runs on a cluster of its own (--scheduler), all of whose tasks go to its
    workers, so the death happens every time."""
    import os

    from dask.distributed import LocalCluster
    import torch
    threads = torch.get_num_threads()
    monkeypatch.setattr(distributed, "SERIAL_BELOW_S", 0)   # this small sweep on workers all the same
    assert main(ARGS + ["--out", str(tmp_path / "serial")]) == 0
    assert main(ARGS + ["--out", str(tmp_path / "dask"), "--workers", "2"]) == 0
    serial, dask = RunStore(tmp_path / "serial").trials(), RunStore(tmp_path / "dask").trials()
    assert len(dask) == 2 * 2 * 2 * 5
    pd.testing.assert_frame_equal(serial, dask)
    # this process started on its own threads (it shares them out only once a worker is ready) and has them back
    assert RunStore(tmp_path / "dask").read_manifest()["provenance"]["torch_threads"] == threads
    assert torch.get_num_threads() == threads

    saved = dict(os.environ)
    os.environ[distributed.FAULT_ENV] = str(tmp_path / "killed-once")   # inherited by the workers
    try:
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                          silence_logs=40) as cluster:
            assert main(ARGS + ["--out", str(tmp_path / "faulty"), "--scheduler", cluster.scheduler_address]) == 0
    finally:   # the nannies copy dask's worker variables into this process's environment
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)
    assert (tmp_path / "killed-once").exists()          # a worker really died mid-sweep
    pd.testing.assert_frame_equal(serial, RunStore(tmp_path / "faulty").trials())


def test_workers_flag_errors(tmp_path, capsys):
    assert main(ARGS + ["--out", str(tmp_path / "x"), "--workers", "0"]) == 2
    assert main(ARGS + ["--out", str(tmp_path / "x"), "--workers", "2", "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_unreachable_scheduler_is_one_line_exit_1_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(ARGS + ["--out", str(out), "--scheduler", "tcp://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Dask scheduler answered at tcp://127.0.0.1:9" in err
    assert not out.exists()


def test_shared_threads_shares_out_this_process_threads_and_restores_them():
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        with distributed.shared_threads(2):
            assert torch.get_num_threads() == 2
        with distributed.shared_threads(8):
            assert torch.get_num_threads() == 1            # at least one each
        assert torch.get_num_threads() == 5
        with pytest.raises(RuntimeError), distributed.shared_threads(2):
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 5
    finally:
        torch.set_num_threads(before)


def test_workers_run_in_the_serial_environment_not_dasks():
    """dask's worker defaults slowed a cell 4x (MALLOC_TRIM_THRESHOLD_=65536: every large tensor
    mmap'ed and zero-filled anew) and spinning OpenMP threads oversubscribe the cores; the
    workers get neither, and this process's environment is left as it was."""
    import os
    env = distributed.worker_environment(2)
    assert env["MALLOC_TRIM_THRESHOLD_"] is None and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["OMP_NUM_THREADS"] == "2"
    before = dict(os.environ)
    names = ("MALLOC_TRIM_THRESHOLD_", "OMP_WAIT_POLICY")
    with distributed.cluster(2, None) as client:
        client.wait_for_workers(2, timeout=120)      # they start in the background
        seen = client.run(lambda: {k: __import__("os").environ.get(k) for k in names})
    assert len(seen) == 2
    assert all(v == {"MALLOC_TRIM_THRESHOLD_": None, "OMP_WAIT_POLICY": "PASSIVE"} for v in seen.values()), seen
    assert dict(os.environ) == before


def test_a_task_is_one_chunk_of_a_data_group():
    """Cells that share data are one task per chunk (their data drawn once per task, not once
    per cell), cut small enough for three tasks per worker but not below 8 trials; resumed cells
    start at their own first missing trial."""
    from harness.sweep import SweepConfig
    config = SweepConfig(scenarios=("gaussian", "heavy_tail"), schemes=("tq-kv", "plain-kv"), budgets=(2, 3),
                         dims=(16,), seq_lens=(32,), queries=(4,), trials=40, device="cpu")
    cells = config.cells()
    tasks = distributed.plan_tasks(config, cells, {}, None, workers=2)
    assert [(t.start, t.stop, len(c)) for t, c in tasks] == [(0, 12, 4), (12, 26, 4), (26, 40, 4)] * 2   # short first
    assert all(len({c.data_key for c in task_cells}) == 1 for _, task_cells in tasks)
    one_group = [c for c in cells if c.scenario == "gaussian"]
    start = {one_group[0]: 20, one_group[1]: 39}
    tasks = distributed.plan_tasks(config, one_group, start, None, workers=1)
    assert [(t.start, t.stop, len(c)) for t, c in tasks] == [(0, 6, 2), (6, 20, 2), (20, 25, 3), (25, 39, 3),
                                                              (39, 40, 4)]
    small = SweepConfig(**{**config.__dict__, "trials": 10})
    assert [(t.start, t.stop) for t, _ in distributed.plan_tasks(small, small.cells(), {}, None, workers=2)] == \
        [(0, 5), (5, 10)] * 2


def test_the_gate_starts_workers_only_where_the_measured_work_left_pays_for_them():
    """distributed.Gate, on measured tasks (units, seconds, CPU s, idle CPU s): nothing before
    two tasks; no probe where even a perfect speed-up could not pay the start; the probe's speed
    on the shared threads and the idle CPU it saw give the speed-up; a busy machine (no idle
    CPU) starts none, however well one thread keeps up."""
    gate = distributed.Gate(workers=2, threads=2, shared=1, startup_s=3.0, cpus=2)
    assert gate.decide(1000, 10) == "alone"
    gate.ran(10, 6.0, 2, 11.0, 0.5)                 # the first task: 1 s of work, 5 s one-time
    assert gate.decide(1000, 10) == "alone"
    gate.ran(10, 1.0, 2, 1.8, 0.1)                  # 0.1 s a unit: W = 5 s, C = 8 s
    assert gate.decide(100, 10) == "alone"          # 10 s left: even 2x saves 5 s < 8 + 1
    assert gate.decide(1000, 10) == "probe"         # 100 s left: 2x would save 50 s
    quiet = distributed.Gate(workers=2, threads=2, shared=1, startup_s=3.0, cpus=2)
    busy = distributed.Gate(workers=2, threads=2, shared=1, startup_s=3.0, cpus=2)
    for gate_, idle in ((quiet, 1.4), (busy, 0.0)):
        gate_.ran(10, 6.0, 2, 11.0, 0.5)
        gate_.ran(10, 1.0, 2, 1.8, 0.1)
        gate_.ran(10, 1.4, 1, 1.4, idle)            # one thread: 1.4x slower; a core idle, or none
    assert quiet.decide(1000, 10) == "start" and "speed-up of 1.43" in quiet.reason     # 2 / 1.4
    assert quiet.decide(150, 10) == "alone"         # 15 s left save 4.5 s, less than C
    assert busy.decide(1000, 10) == "alone" and "speed-up of 0.71" in busy.reason
    one_thread = distributed.Gate(workers=2, threads=1, shared=1, startup_s=None, cpus=2)
    one_thread.ran(10, 3.0, 1, 3.0, 1.0)
    one_thread.ran(10, 1.0, 1, 1.0, 0.5)            # half a core idle: 1.5x; W = 2 s, C = 4 s
    assert one_thread.decide(1000, 10) == "start" and "speed-up of 1.50" in one_thread.reason
    assert distributed.Gate(workers=4, threads=2, shared=1, startup_s=0, cpus=1).decide(1000, 10) == "alone"


def test_tasks_are_cut_for_the_workers_once_they_are_ready():
    """The serial chunks this process runs alone are cut, when workers are ready, into at least
    three tasks per worker where the trials allow (pieces of at least 8, in trial order, every
    cell of the chunk on each)."""
    cells = ["a", "b"]
    tasks = [(range(0, 6), cells), (range(6, 30), cells), (range(0, 30), cells[:1])]
    cut = distributed.split_tasks(tasks, workers=2)
    assert [(t.start, t.stop) for t, _ in cut] == [(0, 6), (6, 14), (14, 22), (22, 30), (0, 10), (10, 20), (20, 30)]
    assert [len(c) for _, c in cut] == [2, 2, 2, 2, 1, 1, 1]
    assert distributed.split_tasks(tasks * 3, workers=2) == tasks * 3       # enough already


def test_workers_that_would_not_pay_are_not_started_and_the_run_says_so(tmp_path, monkeypatch, capsys):
    """Past the up-front estimate (here set to let any sweep through), a sweep whose first tasks
    show that workers would not pay runs alone, says so in one line, and stores the serial rows."""
    def no_start(self):
        raise AssertionError("workers were started for a sweep they cannot speed up")
    monkeypatch.setattr(distributed, "SERIAL_BELOW_S", 1e-9)
    monkeypatch.setattr(distributed.Helpers, "start", no_start)
    assert main(ARGS + ["--out", str(tmp_path / "w"), "--workers", "2"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness run: ran serially, not on 2 workers: starting them did not pay")
    assert main(ARGS + ["--out", str(tmp_path / "s")]) == 0
    pd.testing.assert_frame_equal(RunStore(tmp_path / "w").trials(), RunStore(tmp_path / "s").trials())
