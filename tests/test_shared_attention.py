"""The exact attention (logits, probabilities, T) of a chunk is computed once and shared by
every cell of the chunk; metrics identical to computing it per cell."""
import pandas as pd
import torch

import stats.metrics
from harness import cell as engine
from harness.sweep import SweepConfig
from stats.metrics import exact_attention, trial_metrics


def test_trial_metrics_with_the_exact_attention_given_are_identical():
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(3, 2, 40, 16, generator=g) for _ in range(3))
    k_hat, v_hat = k + 0.1 * torch.randn(k.shape, generator=g), v + 0.1 * torch.randn(v.shape, generator=g)
    logits_hat = stats.metrics.exact_logits(q, k_hat)
    alone = trial_metrics(k, v, q[:, :, :5], k_hat, v_hat, logits_hat[:, :, :5])
    shared = trial_metrics(k, v, q[:, :, :5], k_hat, v_hat, logits_hat[:, :, :5],
                           exact=exact_attention(q[:, :, :5], k, v))
    assert alone.keys() == shared.keys()
    assert all(torch.equal(alone[name], shared[name]) for name in alone)


def test_runner_computes_the_exact_attention_once_per_chunk(monkeypatch):
    calls = []

    def counting(q, k, v):
        calls.append(q.shape[0])
        return exact_attention(q, k, v)
    monkeypatch.setattr(engine, "exact_attention", counting)
    monkeypatch.setattr(stats.metrics, "exact_attention", counting)
    config = SweepConfig(scenarios=("spectral_decay",), schemes=("tq-kv", "sq-qkv", "int4"), budgets=(2, 3),
                         dims=(16,), seq_lens=(32,), queries=(4,), trials=5, calib_tokens=(32,))
    cells = config.cells()
    budget = 3 * engine.bytes_per_trial(config, cells[0])                     # chunks of 2 and 3 trials (short first)
    device = torch.device("cpu")

    def rows(todo):
        out = []
        engine.run_serial(config, todo, device, torch.float32, budget, lambda c, r, w, p: out.extend(r))
        return pd.DataFrame(out).sort_values(["scheme", "budget", "trial"], ignore_index=True)
    together = rows(cells)
    assert calls == [2, 3]                                                    # not once per cell
    calls.clear()
    apart = pd.concat([rows([cell]) for cell in cells]).sort_values(["scheme", "budget", "trial"],
                                                                     ignore_index=True)   # one cell at a time
    # each cell's chunks, and the one trial checked for each codec (cell.check_sample measures it
    # alone; with no other cell in the chunk, no exact side is shared with it)
    assert sorted(calls) == sorted([2, 3] * len(cells) + [1] * len({c.scheme for c in cells}))
    pd.testing.assert_frame_equal(together, apart, check_exact=True)
