"""scripts/peer_bench.py's plumbing, on fake peers written here (no public source needed): each
peer runs its own code in one process, the figures and ratios come from the timed samples, a
width a peer refuses is reported missing, and bad input is one line with exit status 2."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("peer_bench", ROOT / "scripts" / "peer_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


peer_bench = _script()

# A fake public implementation: the package `fakequant`, whose codec sleeps DELAY s per encode and
# decodes to SCALE · x; its constructor imports a submodule lazily (as real peers do) and refuses
# widths above MAX_BITS.
FAKE_INIT = """
import time

DELAY, SCALE, MAX_BITS = {delay}, {scale}, {max_bits}


class Codec:
    def __init__(self, dim, bits):
        from .limits import check     # a lazy import: resolves only inside the peer's isolation
        check(bits, MAX_BITS)
        self.bits = bits

    def encode(self, x):
        time.sleep(DELAY)
        return x.clone()

    def decode(self, codes):
        return codes * SCALE
"""
FAKE_LIMITS = """
def check(bits, max_bits):
    if bits > max_bits:
        raise ValueError(f"bits must be 1..{max_bits}")
"""
DELAY = 0.02


def _fake_checkout(folder: Path, scale: float, max_bits: int, delay: float = DELAY) -> Path:
    package = folder / "fakequant"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_INIT.format(delay=delay, scale=scale, max_bits=max_bits))
    (package / "limits.py").write_text(FAKE_LIMITS)
    return folder


def _build(pkg, dim, bits):
    codec = pkg.Codec(dim, bits)
    return codec.encode, codec.decode


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """Two fake peers of one package name: 'exact' (x̂ = x, every width) and 'half' (x̂ = x/2,
    widths 1 only), registered as PEERS."""
    monkeypatch.setattr(peer_bench, "PEERS", {
        "exact": peer_bench.Peer("someone/exact", "fakequant", _build, "fakequant.Codec"),
        "half": peer_bench.Peer("someone/half", "fakequant", _build, "fakequant.Codec")})
    return {"exact": _fake_checkout(tmp_path / "exact", 1.0, 8), "half": _fake_checkout(tmp_path / "half", 0.5, 1)}


def test_figures_ratios_and_missing_widths_from_the_samples(fakes):
    peers = peer_bench.parse_peers([f"{name}={folder}" for name, folder in fakes.items()])
    result = peer_bench.side_by_side(peers, [1, 2], dim=32, repeats=2)
    assert not any(name.startswith("fakequant") for name in sys.modules)   # the peers' modules stay apart
    n = 2 * 8 * 1024
    assert result["vectors"] == n
    for bits, w in result["widths"].items():
        samples = w["samples_s"]
        assert all(len(times) == 2 for times in samples.values())
        rates = {name: n / min(times) for name, times in samples.items()}
        assert w["vectors_per_s"]["kvharness"] == pytest.approx(rates["kvharness"], rel=1e-12)
        # each encode+decode of the fake sleeps DELAY s on K and on V
        assert w["vectors_per_s"]["exact"] <= n / (2 * DELAY)
        assert w["ratio"]["exact"] == pytest.approx(min(samples["exact"]) / min(samples["kvharness"]), rel=1e-12)
        present = [rates[name] for name in ("exact", "half") if name in samples]
        assert w["ratio_to_best_peer"] == pytest.approx(rates["kvharness"] / max(present), rel=1e-12)
        # each peer ran its own code: x̂ = x has no error, x̂ = x/2 has ‖x/2‖² = 1/4 on unit vectors
        assert w["mse"]["exact"] == 0.0
        assert w["mse_lloyd_max"] == pytest.approx(peer_bench.beta_codebook(32, bits).normalized_distortion)
        # tq-kv's error on 16,384 unit vectors is the Lloyd–Max value within 3 %
        assert w["mse"]["kvharness"] == pytest.approx(w["mse_lloyd_max"], rel=0.03)
    one, two = result["widths"][1], result["widths"][2]
    assert one["mse"]["half"] == pytest.approx(0.25, rel=1e-6) and one["missing"] == {}
    assert two["vectors_per_s"]["half"] is None and two["ratio"]["half"] is None and two["mse"]["half"] is None
    assert "half" not in two["samples_s"]
    assert two["missing"] == {"half": "ValueError: bits must be 1..1"}
    table = peer_bench.markdown(result)
    assert "missing (ValueError: bits must be 1..1)" in table
    assert f"({one['ratio']['half']:.2f}x)" in table and f"| {two['ratio_to_best_peer']:.2f}x |" in table
    assert "load average" in table


@pytest.mark.parametrize("text, widths", [("1-8", list(range(1, 9))), ("3", [3]), ("2-4,7", [2, 3, 4, 7]),
                                          ("5,1", [1, 5])])
def test_widths_read(text, widths):
    assert peer_bench.parse_widths(text) == widths


@pytest.mark.parametrize("argv, names", [
    (["--peer", "nobody=/tmp"], "unknown peer 'nobody'; known names: exact, half"),
    (["--peer", "exact"], "is not NAME=PATH"),
    (["--peer", "exact=/nonexistent/peer"], "holds no fakequant/__init__.py"),
    ([], "give at least one --peer"),
    (["--peer", "exact={exact}", "--peer", "exact={exact}"], "given twice"),
    (["--peer", "exact={exact}", "--widths", "0-3"], "outside 1..8"),
    (["--peer", "exact={exact}", "--widths", "9"], "outside 1..8"),
    (["--peer", "exact={exact}", "--widths", "4-2"], "backwards"),
    (["--peer", "exact={exact}", "--widths", "two"], "not understood"),
    (["--peer", "exact={exact}", "--widths", "1,1"], "a width twice"),
    (["--peer", "exact={exact}", "--repeats", "0"], "--repeats must be a positive integer"),
    (["--peer", "exact={exact}", "--dim", "96"], "--dim 96"),
    (["--peer", "exact={exact}", "--dim", "x"], "invalid int value"),
])
def test_bad_input_is_one_line_and_exit_2(fakes, capsys, argv, names):
    argv = [a.format(exact=fakes["exact"]) for a in argv]
    assert peer_bench.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: peer_bench") and names in err


def test_the_script_exits_2_on_an_unknown_peer():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "peer_bench.py"), "--peer", "nobody=."],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"error: peer_bench: unknown peer 'nobody'; known names: {', '.join(sorted(peer_bench.PEERS))}"]


@pytest.mark.parametrize("seed", [0, 42])
def test_the_data_is_not_the_stream_a_peer_draws_its_rotation_from(seed):
    """A Haar rotation by QR of torch.randn(d, d) at the data's own seed is aligned with the first d
    data vectors (at seed 0 both Haar peers' MSE at b = 4 was 16 % above the Lloyd–Max value): the
    data's first rows are none of the rows of such a draw at the peers' default seeds."""
    import torch
    k, v = peer_bench.unit_caches(32)
    draw = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed))
    rows = draw / torch.linalg.vector_norm(draw, dim=-1, keepdim=True)
    for x in (k, v):
        assert (x[0, 0, :32] @ rows.T).abs().max() < 0.9
