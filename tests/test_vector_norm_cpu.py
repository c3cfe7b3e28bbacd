"""kvcommon/vector_norm_cpu.py: the order norm_order finds reproduces torch.linalg.vector_norm on
rows it did not probe, including rows whose tail past the vectors decides the sum's last bits."""
import numpy as np
import pytest
import torch

from kvcommon import vector_norm_cpu


def _tail_heavy(n_rows, d, dtype, seed):
    """Gaussian rows of scales 1e-3..1e3; in half of them the entries before the last d mod 16
    are 1e-9..1 times smaller, so the tail's few terms decide the last bits."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n_rows, d)) * 10.0 ** rng.uniform(-3, 3, (n_rows, 1))
    rows[n_rows // 2:, : d - d % 16] *= 10.0 ** rng.uniform(-9, 0, (n_rows - n_rows // 2, 1))
    return torch.from_numpy(rows).to(dtype)


@pytest.mark.parametrize("dtype, d", [(torch.float64, 77), (torch.float64, 777), (torch.float64, 4099),
                                      (torch.float32, 65), (torch.float32, 121), (torch.float32, 777),
                                      (torch.float32, 128), (torch.float64, 1024)])
def test_the_order_found_reproduces_vector_norm_where_the_tail_decides(dtype, d):
    """Lengths with a tail past the vectors (a probe of like rows only took the unfused tail at
    float64 77, 777 and 4099 and float32 121 and 777, which differ here; one with fewer
    tail-heavy rows took it at float32 65) and two without one: the order found gives
    vector_norm's bits on 2000 rows it never saw, or there is none and the callers use torch."""
    order = vector_norm_cpu.norm_order(dtype, d)
    if order is None:
        assert d % 8 >= 5 and dtype == torch.float32      # the tails no candidate reproduces
        return
    x = _tail_heavy(2000, d, dtype, seed=d)
    got = np.empty(2000, dtype=x.numpy().dtype)
    vector_norm_cpu._norm_rows(x.numpy(), *order, got)
    assert np.array_equal(got, torch.linalg.vector_norm(x, dim=-1).numpy())
