"""harness bench's memory bandwidth (a STREAM triad) and the least bytes each codec's
encode+decode moves, checked against hand formulas from the codecs' documented layouts."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from harness import bandwidth
from harness.cli import main

D, S = 64, 32     # the bench codes (8, 1, S, d) float32 K and V


@pytest.fixture(scope="module")
def bench_json():
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["bench", "--json", "--dim", str(D), "--seq-len", str(S), "--queries", "4", "--trials", "2",
                     "--repeats", "1", "--schemes", "tq-kv,plain-kv,int4,tq-qkv", "--budgets", "2,3",
                     "--triad-mib", "2"])
    assert code == 0
    return json.loads(out.getvalue())


def test_codec_bytes_per_vector_match_the_documented_layouts(bench_json):
    """Per vector (d float32 in, d float32 out), the codes as each codec's docstring lays them
    out: TurboQuant d·b bits packed + a float32 norm (signs and codebooks are per-model: not per
    vector); tq-qkv sketches K (b−1 bits of codes, d sketch bits, a float32 residual norm) and
    codes V at b bits; int4 4 bits a channel, an fp16 minimum and scale per 32 channels, and an
    int16 shift per tensor and trial (over the trial's H·S = S vectors of that tensor)."""
    def minimum(code_bytes):
        return 2 * (D * 4 + code_bytes)
    expected = {}
    for b in (2, 3):
        expected[("tq-kv", b)] = D * b / 8 + 4
        expected[("plain-kv", b)] = D * b / 8 + 4
        k_code = D * (b - 1) / 8 + 4 + D / 8 + 4
        v_code = D * b / 8 + 4
        expected[("tq-qkv", b)] = (k_code + v_code) / 2
        expected[("int4", b)] = D * 4 / 8 + (D // 32) * (2 + 2) + 2 / S
    code = bench_json["schemes_code_bytes_per_vector"]
    total = bench_json["schemes_bytes_per_vector"]
    for (name, b), code_bytes in expected.items():
        assert code[name]["torch"][str(b)] == pytest.approx(code_bytes, rel=1e-12), (name, b)
        assert total[name]["torch"][str(b)] == pytest.approx(minimum(code_bytes), rel=1e-12), (name, b)
    # at d = 64, b = 2: 2·(256 + 16 + 4) = 552 bytes, against 512 for the float32 vector in and out
    assert total["tq-kv"]["torch"]["2"] == 552


def test_fraction_is_throughput_times_bytes_over_the_triads_rate(bench_json):
    bw = bench_json["bandwidth"]
    rates, total = bench_json["schemes_vectors_per_s"], bench_json["schemes_bytes_per_vector"]
    fraction = bench_json["schemes_fraction_of_bandwidth"]
    assert set(fraction) == set(total) == set(rates) == {"tq-kv", "plain-kv", "int4", "tq-qkv"}
    for name, by_impl in fraction.items():
        for impl, by_b in by_impl.items():
            assert set(by_b) == {"2", "3"}
            for b, f in by_b.items():
                assert f == pytest.approx(rates[name][impl][b] * total[name][impl][b] / (bw["gb_per_s"] * 1e9))
                assert f > 0


def test_triad_counts_stream_bytes(bench_json):
    """2 MiB float64 arrays: 262,144 elements, 3 × 8 bytes each a pass (read b and c, write a);
    the rate is from the fastest of the repetitions (max(5, --repeats))."""
    bw = bench_json["bandwidth"]
    n = (2 << 20) // 8
    assert bw["elements"] == n and bw["array_bytes"] == 2 << 20
    assert bw["bytes_per_element"] == 24 and bw["bytes_per_pass"] == 3 * 8 * n
    assert len(bw["samples_s"]) == bw["repeats"] == 5
    assert bw["gb_per_s"] == pytest.approx(3 * 8 * n / min(bw["samples_s"]) / 1e9)
    assert bw["threads"] == bench_json["threads"] == torch.get_num_threads()
    if bw["llc_bytes"]:
        assert bw["array_over_llc"] == pytest.approx((2 << 20) / bw["llc_bytes"])
    assert "peak_gb_per_s" not in bw    # a CPU has no stated peak here


def test_text_output_shows_bandwidth_bytes_and_fraction(capsys):
    assert main(["bench", "--dim", "32", "--seq-len", "32", "--queries", "4", "--trials", "2", "--repeats", "1",
                 "--schemes", "tq-kv", "--budgets", "4", "--triad-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory bandwidth" in out and "24 bytes per element" in out and "arrays of 1 MiB" in out
    # tq-kv at d = 32, b = 4: 2·(128 + 16 + 4) = 296 bytes per vector
    line = next(line for line in out.splitlines() if "tq-kv" in line and " B " in line)
    assert "b=4: 296.0 B" in line and line.rstrip().endswith("%")


def test_triad_result_and_byte_count():
    r = bandwidth.triad(3 * 8 * 1000 + 5, torch.device("cpu"), repeats=2)   # rounded down to 3000 elements
    assert r["elements"] == 3000 and r["bytes_per_pass"] == 3 * 8 * 3000 and len(r["samples_s"]) == 2


def test_default_array_size_follows_streams_rule():
    mib = 1 << 20
    assert bandwidth.triad_array_bytes(32 * mib, 64 << 30) == 128 * mib         # 4x the cache
    assert bandwidth.triad_array_bytes(2 * mib, 64 << 30) == 64 * mib           # at least 64 MiB
    assert bandwidth.triad_array_bytes(None, 64 << 30) == 64 * mib
    assert bandwidth.triad_array_bytes(480 * mib, 8 << 30) == 1024 * mib        # an eighth of 8 GiB


def test_last_level_cache_sums_the_distinct_highest_level_caches(tmp_path, monkeypatch):
    """Two CPUs with their own L2 and one shared L3 of 32 MiB, and a second L3 of 16 MiB shared by
    two others: 48 MiB (L1 instruction caches skipped, each shared cache counted once)."""
    layout = {0: [(1, "Data", "48K", "0"), (1, "Instruction", "32K", "0"), (2, "Unified", "2048K", "0"),
                  (3, "Unified", "32M", "0-1")],
              1: [(1, "Data", "48K", "1"), (2, "Unified", "2048K", "1"), (3, "Unified", "32M", "0-1")],
              2: [(3, "Unified", "16384K", "2-3")], 3: [(3, "Unified", "16384K", "2-3")]}
    for cpu, caches in layout.items():
        for i, (level, kind, size, shared) in enumerate(caches):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{i}"
            d.mkdir(parents=True)
            for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
                (d / name).write_text(f"{value}\n")
    real_glob = bandwidth.glob.glob
    monkeypatch.setattr(bandwidth.glob, "glob",
                        lambda pattern: real_glob(pattern.replace("/sys/devices/system/cpu", str(tmp_path))))
    assert bandwidth.last_level_cache_bytes(torch.device("cpu")) == 48 << 20
    monkeypatch.setattr(bandwidth.glob, "glob", lambda pattern: [])
    assert bandwidth.last_level_cache_bytes(torch.device("cpu")) is None


def test_gpu_peak_is_double_data_rate_clock_times_bus_width(monkeypatch):
    """NVIDIA's H100 SXM5: HBM3 at 2619 MHz on a 5120-bit bus, stated as 3.35 TB/s."""
    props = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120, L2_cache_size=50 << 20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    peak, source = bandwidth.device_peak(torch.device("cuda"))
    assert math.isclose(peak, 3352.3, rel_tol=1e-4) and "torch" in source
    assert bandwidth.last_level_cache_bytes(torch.device("cuda")) == 50 << 20
    assert bandwidth.device_peak(torch.device("cpu")) is None


def test_bad_triad_size(capsys):
    assert main(["bench", "--triad-mib", "0"]) == 2
    assert "--triad-mib must be a positive integer" in capsys.readouterr().err
    assert main(["bench", "--triad-mib", str(1 << 40)]) == 2
    err = capsys.readouterr().err
    assert "lower --triad-mib" in err and len(err.strip().splitlines()) == 1


def test_lines_with_a_device_peak_give_each_codecs_share_of_it(bench_json):
    """Where the device states its peak (a GPU), each codec's fraction of the peak is its fraction
    of the triad times the triad's share of the peak."""
    result = json.loads(json.dumps(bench_json))
    bw = result["bandwidth"]
    bw.update(peak_gb_per_s=4 * bw["gb_per_s"], peak_source="test", fraction_of_peak=0.25)
    lines = bandwidth.bandwidth_lines(result)
    assert lines[1].startswith("device peak") and "reaches 25% of it" in lines[1]
    f = result["schemes_fraction_of_bandwidth"]["int4"]["torch"]["2"]
    row = next(line for line in lines if line.strip().startswith("int4"))
    assert f"{f:.1%} ({f / 4:.1%})" in row
    assert not any(line.startswith("device peak") for line in bandwidth.bandwidth_lines(bench_json))


def test_gpu_check_says_so_and_exits_0_without_a_gpu(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would run the whole check")
    run = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                                                     "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "no GPU figures: torch.cuda.is_available() is False" in run.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device.txt"]
    run = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                                                     "PYTHON": str(tmp_path / "no-python")},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "cannot import torch" in run.stderr
