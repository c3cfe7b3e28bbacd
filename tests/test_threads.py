"""kvcommon.threads.small_linalg: scoped single-threading of small linear algebra, restored
afterwards, and rows identical with it and without it."""

import numpy as np
import pandas as pd
import pytest
import torch
from threadpoolctl import threadpool_info

import schemes
from harness.cell import run_serial
from harness.sweep import SweepConfig
from kvcommon import threads
from kvcommon.threads import torch_threads
from schemes.registry import reference_specs


def _blas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_small_linalg_limits_and_restores_threads():
    with torch_threads(2):
        blas = _blas_threads()
        with threads.small_linalg():
            assert torch.get_num_threads() == 1
            assert set(_blas_threads()) == {1}
            with threads.small_linalg():                    # nesting keeps one thread
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2 and _blas_threads() == blas
        with pytest.raises(RuntimeError), threads.small_linalg():
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2 and _blas_threads() == blas


def test_small_linalg_as_decorator_and_switched_off():
    @threads.small_linalg()
    def inside():
        return torch.get_num_threads()

    with torch_threads(2):
        assert inside() == 1 and torch.get_num_threads() == 2
        with threads.enabled(False):
            assert inside() == 2
        assert inside() == 1


def _sweep_rows(impl: str, names: tuple[str, ...], dim: int = 32) -> pd.DataFrame:
    config = SweepConfig(scenarios=("spectral_decay", "rope_lowrank"), schemes=names, budgets=(3,), dims=(dim,),
                         seq_lens=(64,), queries=(8,), trials=2, calib_tokens=(64,), impl=impl)
    config.validate()
    rows = []
    run_serial(config, config.cells(), torch.device("cpu"), torch.float32, None,
                lambda cell, cell_rows, wall, peak: rows.extend(cell_rows))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("impl", ["torch", "reference"])
def test_rows_identical_with_and_without_small_linalg(impl):
    """A fixed-seed sweep of every built-in and plug-in scheme (and every reference codec) gives identical
    rows with the thread limits on and off. Torch runs on one thread in both runs: MKL's LAPACK
    (torch on the CPU) changes its last bits with the thread count, which is a separate matter
    (test_rows_do_not_depend_on_torch_threads); NumPy's OpenBLAS runs at its default in both."""
    names = tuple(schemes.registry.all_schemes()) if impl == "torch" else tuple(reference_specs())
    with torch_threads(1):
        with threads.enabled(False):
            before = _sweep_rows(impl, names)
        after = _sweep_rows(impl, names)
    assert len(after) == 2 * 2 * len(names)
    pd.testing.assert_frame_equal(before, after, check_exact=True)
    assert np.isfinite(after["rel_mse_k"]).all()


def test_rows_do_not_depend_on_torch_threads():
    """With the small linear algebra on one thread, every scheme's rows are the same whatever
    torch's thread count (MKL's QR and eigh alone change their last bits with it, and an
    eigenvector's sign with them, which redraws a sign-sensitive sketch: before the threads
    module, sketched SQ, Shard and SVD rows depended on the machine's core count)."""
    names = tuple(schemes.registry.all_schemes())   # kvpress presses run no small linear algebra of ours
    runs = []
    for n in (1, 3):
        with torch_threads(n):
            runs.append(_sweep_rows("torch", names, dim=64))   # at d = 32 MKL agrees across threads anyway
    pd.testing.assert_frame_equal(runs[0], runs[1], check_exact=True)


def test_by_matrix_gives_one_threads_bits_on_the_whole_batch():
    """threads.by_matrix: the eigh and QR of a batch of covariances split between 2 or 3 threads
    (uneven blocks, the caller's batch dimensions kept) are one thread's results on the whole
    batch bit for bit, and the thread count is restored; switched off (threads.enabled(False)),
    fn runs as torch runs it, at the caller's thread count."""
    gen = torch.Generator().manual_seed(3)
    for d in (64, 128):
        x = torch.randn(5, 2, 2 * d, d, generator=gen, dtype=torch.float64)
        cov = x.transpose(-1, -2) @ x / (2 * d)
        with threads.small_linalg():
            values, vectors = torch.linalg.eigh(cov)
            q, r = torch.linalg.qr(cov)
        for n in (1, 2, 3):
            with torch_threads(n):
                got = threads.by_matrix(lambda c: tuple(torch.linalg.eigh(c)), cov)
                got_qr = threads.by_matrix(lambda c: tuple(torch.linalg.qr(c)), cov)
                assert torch.get_num_threads() == n
            assert got[0].shape == (5, 2, d) and got[1].shape == (5, 2, d, d)
            assert torch.equal(got[0], values) and torch.equal(got[1], vectors)
            assert torch.equal(got_qr[0], q) and torch.equal(got_qr[1], r)
    seen = []
    with torch_threads(2), threads.enabled(False):
        threads.by_matrix(lambda c: (seen.append(torch.get_num_threads()) or c,), cov)
    assert seen == [2]


# --- kvcommon.compiled.batched: the deferred row loops of a codec's K and V in one hand-off ---
def _marking_job(n_rows: int, seen: np.ndarray, width: int = 128):
    """A by_row_blocks job over n_rows rows of `width` elements that counts each row it runs."""
    def run(start, stop):
        seen[start:stop] += 1
    return n_rows, n_rows * width, run


def test_batched_runs_the_held_calls_once_each_in_one_hand_off(monkeypatch):
    """Inside batched, deferred calls wait (outputs untouched) and run on leaving: every row of
    every job exactly once, the shares crossing from one job into the next, with one pool
    submission for two threads where the calls alone would take one each; undeferred calls run
    at once; a nested batched leaves them to the outermost."""
    from kvcommon import compiled
    submitted = []
    pool = compiled._pool()
    monkeypatch.setattr(compiled, "_pool", lambda: type("P", (), {"submit": lambda _, *a: submitted.append(a) or pool.submit(*a)})())
    with torch_threads(2):
        k_seen, v_seen, now_seen = np.zeros(1001, int), np.zeros(999, int), np.zeros(600, int)
        with compiled.batched():
            compiled.by_row_blocks(*_marking_job(1001, k_seen), deferred=True)
            with compiled.batched():
                compiled.by_row_blocks(*_marking_job(999, v_seen), deferred=True)
            compiled.by_row_blocks(*_marking_job(600, now_seen))          # not deferred: runs now
            assert not k_seen.any() and not v_seen.any() and (now_seen == 1).all()
            assert len(submitted) == 1
        assert (k_seen == 1).all() and (v_seen == 1).all()
        assert len(submitted) == 2                                         # one for the two held jobs
        k_seen[:] = 0
        compiled.by_row_blocks(*_marking_job(1001, k_seen), deferred=True)  # outside batched: at once
        assert (k_seen == 1).all()


def test_batched_runs_held_calls_when_the_body_raises_and_forgets_memos_when_they_fail():
    from kvcommon import compiled
    from kvcommon.memo import IdentityMemo
    seen = np.zeros(10, int)
    with pytest.raises(KeyError), compiled.batched():
        compiled.by_row_blocks(*_marking_job(10, seen), deferred=True)
        raise KeyError("body")
    assert (seen == 1).all()                                               # written, as memos may hold it
    memo, kept = IdentityMemo(2), torch.zeros(3)
    memo.put((kept,), "value")

    def failing(start, stop):
        raise ValueError("loop")
    with pytest.raises(ValueError), compiled.batched():
        compiled.by_row_blocks(10, 10, failing, deferred=True)
    assert memo.get((kept,)) is None                                       # emptied: nothing half-written served
