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
    # the two processes shared this one's threads (at least one each), and it has its own back
    assert RunStore(tmp_path / "dask").read_manifest()["provenance"]["torch_threads"] == max(1, threads // 2)
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
