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
from schemes.reference import available as reference_available


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
    names = tuple(schemes.registry.all_schemes()) if impl == "torch" else tuple(reference_available())
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
