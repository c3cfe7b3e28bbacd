"""The known-answer benchmark (harness/known_answers.py): each bug wrapper changes the wrapped
codec's output by its stated size (measured here against an independent computation) and is the
codec itself at its neutral size; each harmless change is the stated change; the benchmark runs
end to end, renders its table, and leaves nothing registered."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import schemes
from harness import known_answers as ka
from harness.cli import main
from schemes.registry import SchemeSpec, registered

B, H, S, D = 3, 1, 256, 64
BUG = {b.name: b for b in ka.BUGS}


def _data(seed=0, s=S, d=D, b=B):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, H, s, d, generator=g), torch.randn(b, H, s, d, generator=g)
    q = torch.randn(b, H, 16, d, generator=g)
    k_cal, v_cal = torch.randn(b, H, 256, d, generator=g), torch.randn(b, H, 256, d, generator=g)
    return k, v, q, k_cal, v_cal


def _coded(name, data, budget=2, **options):
    """(scheme, enc, k_hat, v_hat, logits) of a registered scheme on data, fitted with trial indices."""
    k, v, q, k_cal, v_cal = data
    scheme = schemes.create(name, budget=budget, dim=k.shape[-1], seed=11, **options)
    schemes.base.fit_codec(scheme, k_cal, v_cal, torch.arange(len(k)))
    enc = scheme.encode(k, v)
    k_hat, v_hat = scheme.decode(enc)
    logits = scheme.score(q, enc) if scheme.capabilities.scores_on_codes else q @ k_hat.transpose(-1, -2) / math.sqrt(k.shape[-1])
    return scheme, enc, k_hat, v_hat, logits


def _pair(bug, data=None, budget=None):
    """The wrapped codec's and the bug's (scheme, enc, k_hat, v_hat, logits) on the same data."""
    data = data or _data()
    with ka.registered_bugs([bug]):
        return _coded(bug.wrapped, data, budget or bug.budget), _coded(bug.scheme, data, budget or bug.budget)


def _changed_tokens(x, y):
    """Bool (B, H, S): the tokens whose rows differ."""
    return (x != y).any(dim=-1)


def test_there_are_at_least_twenty_bugs_and_eight_harmless_changes():
    assert len(ka.BUGS) >= 20 and len({b.name for b in ka.BUGS}) == len(ka.BUGS)
    assert len(ka.HARMLESS) >= 8
    assert {h.name for h in ka.HARMLESS} >= {"dtype", "rng", "impl", "threads", "chunk-size", "seed", "workers",
                                             "trial-order"}


@pytest.mark.parametrize("bug", ka.BUGS, ids=lambda b: b.name)
def test_each_bug_at_its_neutral_size_is_the_codec_itself(bug):
    clean, bugged = _pair(bug.at(bug.neutral), _data(1))
    for x, y in zip(clean[2:], bugged[2:]):
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bug", ka.BUGS, ids=lambda b: b.name)
def test_each_bug_changes_the_codec_output(bug):
    clean, bugged = _pair(bug, _data(2))
    assert any(not torch.equal(x, y) for x, y in zip(clean[2:], bugged[2:]))


def test_nothing_stays_registered_and_a_taken_name_is_refused():
    before = schemes.available()
    with ka.registered_bugs(ka.BUGS):
        assert "bug:wrong-norm/tq-kv" in schemes.available()
        assert schemes.registry.seed_family("bug:flaky/tq-kv") == "tq"
    assert schemes.available() == before
    with pytest.raises(ValueError, match="taken"):
        with registered([ka.spec_of(ka.BUGS[0]), SchemeSpec("tq-kv", None, "")]):
            pass
    assert schemes.available() == before
    with pytest.raises(RuntimeError):
        with ka.registered_bugs(ka.BUGS):
            raise RuntimeError
    assert schemes.available() == before


def test_wrong_norm_scales_the_decoded_cache_by_its_factor():
    clean, bugged = _pair(BUG["wrong-norm"])
    torch.testing.assert_close(bugged[2], clean[2] * 1.05)
    torch.testing.assert_close(bugged[3], clean[3] * 1.05)


def test_token_fraction_bugs_touch_their_fraction_of_tokens():
    for name, parts in (("stale-seq-len", (2, 3)), ("sign-flip", (2, 3)), ("off-by-one-rotation", (2, 3)),
                        ("v-with-k-codebook", (3,)), ("dropped-zero-point", (2, 3)), ("chunk-boundary", (2, 3))):
        bug = BUG[name]
        clean, bugged = _pair(bug)
        # chunk-boundary: one token per chunk of 1/size tokens but the first chunk's
        expected = (round(S * bug.size) - (name == "chunk-boundary")) / S
        for i in parts:
            changed = _changed_tokens(clean[i], bugged[i])
            assert changed.float().mean().item() == pytest.approx(expected, abs=1e-9), name
        if name == "v-with-k-codebook":
            assert torch.equal(clean[2], bugged[2])


def test_stale_seq_len_zeroes_the_last_tokens_and_sign_flip_negates():
    clean, bugged = _pair(BUG["stale-seq-len"])
    n = round(S * BUG["stale-seq-len"].size)
    assert torch.count_nonzero(bugged[2][:, :, -n:]) == 0 and torch.equal(bugged[2][:, :, :-n], clean[2][:, :, :-n])
    clean, bugged = _pair(BUG["sign-flip"])
    changed = _changed_tokens(clean[2], bugged[2])
    assert torch.equal(bugged[2][changed], -clean[2][changed])


def test_chunk_boundary_repeats_the_previous_token_at_each_boundary():
    clean, bugged = _pair(BUG["chunk-boundary"])
    for i in range(32, S, 32):
        assert torch.equal(bugged[2][:, :, i], clean[2][:, :, i - 1])


def test_channel_mask_codes_the_input_with_its_channels_zeroed():
    bug = BUG["channel-mask"]
    k, v, q, k_cal, v_cal = data = _data(3)
    keep = torch.ones(D)
    masked = ka.spaced(D, bug.size)
    assert masked.sum().item() == round(D * bug.size) == 2
    keep[masked] = 0
    expected = _coded("tq-kv", (k * keep, v * keep, q, k_cal, v_cal))
    _, bugged = _pair(bug, data)
    torch.testing.assert_close(bugged[2], expected[2])


def test_narrow_width_decodes_k_at_one_bit_less():
    data = _data(4)
    _, bugged = _pair(BUG["narrow-width"], data)
    narrow = _coded("tq-kv", data, budget=1)
    clean = _coded("tq-kv", data, budget=2)
    torch.testing.assert_close(bugged[2], narrow[2])
    assert torch.equal(bugged[3], clean[3])


def test_dropped_norm_decodes_every_token_at_the_mean_norm():
    clean, bugged = _pair(BUG["dropped-norm"])
    norms = clean[1].codes["k.norm"]
    expected = clean[2] * (norms.mean(-1, keepdim=True) / norms).unsqueeze(-1)
    torch.testing.assert_close(bugged[2], expected, rtol=1e-5, atol=1e-5)


def test_qjl_scale_equals_the_codec_with_its_constant_changed(monkeypatch):
    bug = BUG["qjl-scale"]
    data = _data(5)
    _, bugged = _pair(bug, data)
    from schemes import qjl
    real = qjl.sketch_scale
    monkeypatch.setattr(qjl, "sketch_scale", lambda m: real(m) * (1 - bug.size))
    k, v, q, k_cal, v_cal = data
    patched = _coded("tq-qkv", (k.clone(), v.clone(), q.clone(), k_cal, v_cal))  # fresh tensors: no memo hits
    torch.testing.assert_close(bugged[2], patched[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bugged[4], patched[4], rtol=1e-5, atol=1e-5)
    assert bug.size == pytest.approx(1 - 2 / math.pi)


def test_stale_codebook_decodes_with_the_table_of_a_larger_dimension():
    from schemes.lloyd_max import beta_codebook
    clean, bugged = _pair(BUG["stale-codebook"])
    stale = torch.tensor(beta_codebook(80, 2).centroids, dtype=torch.float32)
    assert torch.equal(bugged[1].side["codebook.2bit"], stale)
    # the stale table's centroids are √(64/80) of the right one's (Beta marginal's scale 1/√d), so
    # the decoded rows shrink by about that much
    ratio = bugged[2].norm() / clean[2].norm()
    assert ratio.item() == pytest.approx(math.sqrt(64 / 80), rel=0.02)


def test_flaky_codes_its_fraction_of_trials_at_one_bit_less():
    bug = BUG["flaky"]
    data = _data(6, s=32, b=400)
    clean, bugged = _pair(bug, data)
    narrow = _coded("tq-kv", data, budget=1)
    flaky = (clean[2] != bugged[2]).flatten(1).any(dim=1)
    rate, se = flaky.float().mean().item(), math.sqrt(bug.size * (1 - bug.size) / 400)
    assert abs(rate - bug.size) < 4 * se
    torch.testing.assert_close(bugged[2][flaky], narrow[2][flaky])
    assert torch.equal(bugged[2][~flaky], clean[2][~flaky])


def test_floor_rounding_is_an_independent_floor_quantiser():
    k, v, q, k_cal, v_cal = data = _data(7)
    _, bugged = _pair(BUG["floor-rounding"], data)
    groups = k.reshape(B, H, S, -1, 32)
    lo = groups.amin(-1, keepdim=True).half().float()
    step = ((groups.amax(-1, keepdim=True) - lo) / 15).half().float()
    expected = (((groups - lo) / step).floor().clamp(0, 15) * step + lo).reshape(k.shape)
    # each group's maximum keeps its rounded code (it fixes the scale, stored in fp16: its
    # (max − min)/scale is 15 ± a rounding error, which floor would turn into 14 half the time)
    top = (groups == groups.amax(-1, keepdim=True)).reshape(k.shape)
    agree = ((bugged[2] - expected).abs() < 1e-5)[~top]
    assert agree.float().mean().item() > 0.9999   # exact ties round to even: a handful of elements
    assert ((bugged[2] - expected).abs() < 1e-5).float().mean().item() < 0.999   # max elements are not floor


def test_clip_range_clips_its_fraction_of_elements():
    bug = BUG["clip-range"]
    k, v, *_ = _data(8)
    with ka.registered_bugs([bug]):
        scheme = schemes.create(bug.scheme, budget=2, dim=D)
        k2, v2 = bug.pre(scheme, k, v)
    assert (k2 != k).float().mean().item() == pytest.approx(bug.size, abs=2 / (S * D))


def test_dropped_zero_point_decodes_without_the_group_minimum():
    clean, bugged = _pair(BUG["dropped-zero-point"])
    changed = _changed_tokens(clean[2], bugged[2])
    minimum = clean[1].codes["k.min"].float().repeat_interleave(32, dim=-1)
    torch.testing.assert_close(bugged[2][changed], (clean[2] - minimum)[changed], rtol=1e-3, atol=1e-3)


def test_saturated_norms_touch_their_fraction_of_tokens():
    bug = BUG["fp16-norm-overflow"]
    clean, bugged = _pair(bug)
    changed = _changed_tokens(clean[2], bugged[2]).float().mean().item()
    assert changed == pytest.approx(bug.size, abs=2 / S)
    assert (bugged[1].codes["k.norm"] <= clean[1].codes["k.norm"]).all()


def test_kivi_residual_shortens_the_fp16_window():
    bug = BUG["kivi-residual"]
    k, *_ = data = _data(9)
    clean, bugged = _pair(bug, data)
    def exact_tail(k_hat):
        # tokens reproduced to fp16 precision: the fp16 window
        exact = ((k_hat - k).abs() <= 1e-3 * k.abs().clamp(min=1)).all(-1)[0, 0]
        return int(exact.flip(0).cumprod(0).sum())
    assert exact_tail(clean[2]) == 32 and exact_tail(bugged[2]) == 32 - bug.size


def test_int4_group_size_stores_one_group_per_token_at_d_64():
    clean, bugged = _pair(BUG["int4-group-size"])
    assert clean[1].codes["k.min"].shape[-1] == 2 and bugged[1].codes["k.min"].shape[-1] == 1


def test_svd_rank_is_one_less():
    clean, bugged = _pair(BUG["svd-rank"])
    rank = lambda x: int(torch.linalg.matrix_rank(x[0, 0].double(), rtol=1e-4))   # noqa: E731
    assert rank(bugged[2]) == rank(clean[2]) - 1


def test_v_calibrated_on_k_takes_its_fraction_of_k_tokens():
    bug = BUG["v-calibrated-on-k"]
    k_cal, v_cal = torch.randn(2, 1, 100, 8), torch.randn(2, 1, 100, 8)
    with ka.registered_bugs([bug]):
        scheme = schemes.create(bug.scheme, budget=2, dim=8)
    _, seen = bug.fit(scheme, k_cal, v_cal)
    assert torch.equal(seen[:, :, :50], k_cal[:, :, :50]) and torch.equal(seen[:, :, 50:], v_cal[:, :, 50:])


def test_logit_scale_and_inverted_sketch():
    clean, bugged = _pair(BUG["logit-scale"])
    torch.testing.assert_close(bugged[4], clean[4] * 0.7)
    assert torch.equal(bugged[2], clean[2])
    bug = BUG["inverted-sketch"]
    clean, bugged = _pair(bug)
    flipped = (clean[1].codes["k.sketch"] != bugged[1].codes["k.sketch"]).any(-1)
    assert flipped.float().mean().item() == pytest.approx(round(S * bug.size) / S)
    assert torch.equal(bugged[1].codes["k.sketch"][flipped], torch.bitwise_not(clean[1].codes["k.sketch"][flipped]))


def test_uneven_calls_keeps_the_mean_and_widens_the_spread_at_the_codecs_storage():
    """Each trial's K error is (1 ± size) times the codec's, the signs opposite within every pair of
    trials (2j, 2j + 1) and drawn independently of the data: the mean K error over trials is the
    codec's by construction, its trial-to-trial spread wider; V is untouched, and the storage is the
    codec's plus one float32 gain per trial."""
    from schemes.base import BitLedger
    bug = BUG["uneven-calls"]
    k, *_ = data = _data(10, b=8)
    clean, bugged = _pair(bug, data)
    error = lambda x: ((x - k).double() ** 2).flatten(1).sum(1)   # noqa: E731
    ratio = error(bugged[2]) / error(clean[2])
    signs = ka.call_signs(bugged[0], len(k))
    torch.testing.assert_close(ratio, 1 + bug.size * signs, rtol=1e-4, atol=0)
    assert torch.equal(signs.reshape(-1, 2).sum(1), torch.zeros(len(k) // 2, dtype=torch.float64))
    assert torch.equal(bugged[3], clean[3])
    extra = BitLedger.per_trial(bugged[1]).cache - BitLedger.per_trial(clean[1]).cache
    assert extra.tolist() == [32.0] * len(k)
    # the scores move with the decoded K: the gain scales the QJL part of the codec's logits too
    assert not torch.equal(bugged[4], clean[4])


def test_precision_bugs_round_their_scales_toward_zero_and_keep_the_storage():
    from schemes.base import BitLedger
    clean, bugged = _pair(BUG["bf16-norm"])
    before, after = clean[1].codes["k.norm"], bugged[1].codes["k.norm"]
    assert after.dtype == before.dtype and (after <= before).all() and (after < before).any()
    assert ((before - after) / before).max().item() < 2 ** -7
    clean, bugged = _pair(BUG["fp16-codebook"])
    table, rounded = clean[1].side["codebook.2bit"], bugged[1].side["codebook.2bit"]
    assert ((rounded - table).abs() / table.abs()).max().item() <= 2 ** -11 and not torch.equal(rounded, table)
    assert torch.equal(BitLedger.per_trial(bugged[1]).cache, BitLedger.per_trial(clean[1]).cache)


def test_each_bug_states_its_right_answer():
    from stats.validation import VERDICTS
    assert {b.target for b in ka.BUGS} <= set(VERDICTS)
    assert {b.name for b in ka.BUGS if b.target == "negligible"} == {"bf16-norm", "fp16-codebook"}


def test_bugs_install_as_a_plugin_package_that_shares_the_codecs_draws_or_not():
    bug = BUG["sign-flip"]
    before = schemes.available()
    data = _data(11)
    with ka.installed_bugs([bug]), ka.registered_bugs([bug]):
        shared, own = bug.plugin(True), bug.plugin(False)
        assert {shared, own} <= set(schemes.available())
        assert schemes.registry.seed_family(shared) == "tq" and schemes.registry.seed_family(own) == own
        assert schemes.registry.spec(shared).factory is ka.INSTALLED.shared_sign_flip_tq_kv
        # at one seed the plug-in is the in-process bug: the seed family decides only which seed
        for x, y in zip(_coded(bug.scheme, data)[2:], _coded(shared, data)[2:]):
            assert torch.equal(x, y)
    assert schemes.available() == before and not vars(ka.INSTALLED)


# --- the harmless changes and the benchmark ------------------------------------------------
TINY = ka.Settings(dim=32, seq_len=64, queries=8, trials=21, permutations=100, compare_trials=6,
                   compare_schemes=("tq-kv", "int4"), compare_budgets=(2,), skip_slow=True)


@pytest.mark.parametrize("vary", ["dtype", "rng", "impl", "seed"])
def test_validate_cases_vary_what_they_say(vary):
    out = ka.validate_case(TINY, "tq-kv", 3, vary=vary)
    assert out["differs"] == [vary]
    assert f"--vary {vary}" in out["command"]


def test_run_level_changes_are_the_stated_change(tmp_path, monkeypatch):
    from harness import cell as engine
    calls = {"n": 0}
    real = engine.run_cell_chunk

    def counting(scheme, data):
        calls["n"] += 1
        return real(scheme, data)
    monkeypatch.setattr(engine, "run_cell_chunk", counting)
    argv = lambda name: ["run", "--scenario", "gaussian", "--scheme", "tq-kv", "--budget", 2, "--dim", 32,  # noqa: E731
                         "--seq-len", 64, "--queries", 8, "--trials", 21, "--out", tmp_path / name, "--quiet"]
    ka.changed_run(None, argv("plain"))
    assert calls["n"] == 1                       # 21 trials fit one memory-sized chunk
    ka.changed_run("chunk", argv("chunk"))
    assert calls["n"] == 1 + 3                   # chunks of 7
    ka.changed_run("resume", argv("resume"))
    # the first pass stores two chunks and is interrupted at its third (changed_run raises when it
    # is not); the resumed run computes only the third
    assert calls["n"] == 4 + 2 + 1
    ka.changed_run("threads", argv("threads"))
    threads = [json.loads((tmp_path / n / "manifest.json").read_text())["provenance"]["torch_threads"]
               for n in ("plain", "threads")]
    assert threads[0] != threads[1]
    frames = [schemes_frame(tmp_path / n) for n in ("plain", "chunk", "resume", "threads")]
    for f in frames[1:]:
        assert f.equals(frames[0])


def schemes_frame(path: Path):
    from harness.store import RunStore
    from kvcommon.rows import SIX_D
    return RunStore(path).trials().sort_values("trial")[list(SIX_D)].reset_index(drop=True)


@pytest.mark.slow
def test_a_small_benchmark_runs_end_to_end_and_renders_its_table():
    payload = ka.run_selftest(TINY, 1, bugs=[BUG["sign-flip"], BUG["wrong-norm"]],
                              harmless=[h for h in ka.HARMLESS if h.name in ("dtype", "chunk-size", "workers")],
                              seed_compare=True)
    json.dumps(payload)
    assert [c["case"] for c in payload["cases"]] == ["sign-flip", "wrong-norm", "dtype", "chunk-size", "workers",
                                                     "seed-only compare"]
    for bug in payload["cases"][:2]:
        designs = bug["designs"]
        assert list(designs) == list(ka.PLUGIN_DESIGNS)
        assert designs["plug-in, shared draws"]["rows_identical_to_in_process"] == 1
        assert designs["plug-in, own draws"]["rows_identical_to_in_process"] == 0
        assert designs["plug-in, shared draws"]["shared_draws"] == [True]
        assert designs["plug-in, own draws"]["shared_draws"] == [False]
    workers = payload["cases"][4]
    assert workers["repetitions"] == 1 or workers.get("skipped")
    compare = payload["cases"][-1]
    assert compare["cells"] == 2 and sum(compare["verdicts"].values()) == 2
    for c in payload["cases"]:
        assert sum(c["verdicts"].values()) == c["cells"]
    table = ka.table_markdown(payload)
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == len(payload["cases"])
    assert payload["machine"]["cores"] and "load average" in (payload["machine"]["uptime"] or "load average")
    assert not [n for n in schemes.available() if n.startswith("bug:")]


def test_the_shipped_table_renders():
    path = Path(__file__).resolve().parents[1] / "docs" / "data" / "known_answers.json"
    payload = json.loads(path.read_text())
    table = ka.table_markdown(payload)
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == len(payload["cases"]) + 1
    assert {c["case"] for c in payload["cases"]} >= {b.name for b in ka.BUGS} | {h.name for h in ka.HARMLESS}
    for bug in ka.BUGS:
        case = next(c for c in payload["cases"] if c["case"] == bug.name)
        assert case["target"] == bug.target and set(case["designs"]) == set(ka.PLUGIN_DESIGNS)


@pytest.mark.parametrize("argv, message", [(["--repetitions", "0"], "--repetitions 0 must be a positive integer"),
                                           (["--out", "/nonexistent/dir/x.json"], "cannot be written: the directory /nonexistent/dir does not exist")])
def test_selftest_usage_errors(argv, message, capsys):
    assert main(["selftest", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_quick_selftest_end_to_end(tmp_path, capsys):
    out = tmp_path / "quick.json"
    assert main(["selftest", "--quick", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["command"] == "harness selftest --quick"
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == len(payload["cases"]) + 1
    assert not [n for n in schemes.available() if n.startswith("bug:")]
