"""Common random numbers across the variants of a codec family: at one budget and d, the
variants draw the same randomness for a tensor they code alike, so the metrics of that tensor
are equal trial by trial and a variant comparison sees only what the variants do differently."""
import numpy as np
import pandas as pd
import pytest
import torch

import schemes
from harness import cell as engine
from harness.sweep import SweepConfig
from schemes.registry import seed_family

K_ONLY = ("rel_mse_k", "cos_k", "snr_err_k", "dir_err_k", "d2_k", "ptcosine_k", "logit_rel_mse", "kl_attn")
V_ONLY = ("rel_mse_v", "cos_v", "snr_err_v", "dir_err_v", "d2_v", "ptcosine_v")


@pytest.fixture(scope="module")
def rows() -> pd.DataFrame:
    config = SweepConfig(scenarios=("heavy_tail",), schemes=("tq-kv", "tq-kqv", "tq-qkv", "tq-kfv", "sq-kv", "sq-kqv",
                                                             "squ-qkv", "squ-qkqv", "kivi"),
                         budgets=(3,), dims=(32,), seq_lens=(64,), queries=(8,), trials=6, calib_tokens=(64,))
    out = []
    engine.run_serial(config, config.cells(), torch.device("cpu"), torch.float32, None,
                      lambda c, r, w, p: out.extend(r))
    return pd.DataFrame(out).set_index(["scheme", "trial"]).sort_index()


def _pair(rows, a, b, columns):
    return rows.loc[a, list(columns)].to_numpy(), rows.loc[b, list(columns)].to_numpy()


@pytest.mark.parametrize("a, b, same, differ", [
    ("tq-kv", "tq-kqv", K_ONLY, V_ONLY),     # V sketched in one: K coded alike
    ("tq-kv", "tq-kfv", K_ONLY, V_ONLY),
    ("tq-kv", "tq-qkv", V_ONLY, K_ONLY),     # K sketched in one: V coded alike
    ("sq-kv", "sq-kqv", K_ONLY, V_ONLY),
    ("squ-qkv", "squ-qkqv", K_ONLY, V_ONLY),  # both sketch K: the same sketch draw
])
def test_variants_code_alike_what_they_share(rows, a, b, same, differ):
    x, y = _pair(rows, a, b, same)
    assert np.array_equal(x, y)
    x, y = _pair(rows, a, b, differ)
    assert not np.isclose(x, y, rtol=1e-9, atol=0).all(axis=1).any()   # no trial alike on the other tensor


def test_the_seed_family_of_a_codec_without_one_is_its_name():
    assert [seed_family(n) for n in ("tq-kv", "tq-fkfv", "plain-kv", "sq-qkv", "squ-kv")] == \
        ["tq", "tq", "plain", "sq", "squ"]
    for name in ("kivi", "shard", "int4"):
        assert seed_family(name) == name
    config = SweepConfig(scenarios=("gaussian",), schemes=("kivi",), budgets=(3,), dims=(32,), seq_lens=(64,),
                         queries=(8,), trials=1, calib_tokens=(64,))
    scheme = engine.create_scheme(config, config.cells()[0])
    assert scheme.seed == schemes.registry.codec_seed(config.seed, "kivi", 3, 32)


def test_budgets_keep_draws_of_their_own():
    made = [schemes.create("tq-kv", budget=b, dim=32, seed=schemes.registry.codec_seed(0, "tq-kv", b, 32))
            for b in (3, 4)]
    assert made[0].seed != made[1].seed
