"""The compiled loops pick their instructions by the CPU's features (vectors_cpu.has_feature):
AVX-512VL's two-table permutes, AVX2's one-table permutes and gathers. A test run covers the
host's set only, so on an AVX-512 CPU the AVX2 paths are compiled and checked here as well, in a
process whose numba targets an AVX2 CPU (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES without AVX-512): the
register passes' bits against the torch chain, the binary search against bucketize, the packed
lookups against indexing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding
import pytest

from kvcommon.vectors_cpu import has_feature
from schemes.hadamard_cpu import REGISTER_ROWS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not has_feature("avx512vl"), reason="this CPU runs the AVX2 paths in every test already")
def test_the_avx2_paths_give_the_same_bits_on_an_avx512_cpu():
    features = ",".join(f.replace("+avx512", "-avx512") for f in llvmlite.binding.get_host_cpu_features().flatten().split(","))
    env = {**os.environ, "NUMBA_CPU_NAME": "x86-64-v3", "NUMBA_CPU_FEATURES": features}
    probe = "from schemes import scalar_quantizer_cpu as s; print(s.SEARCHED_WIDTHS, s.PERMUTED_MAX_ENTRIES)"
    seen = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert seen.stdout.split() == ["(2,", "3,", "4,", "5,", "6)", "32"], seen.stdout            # the AVX2 choices
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_scalar_quantizer.py::test_the_binary_search_gives_the_count_of_thresholds_below",
                          "tests/test_scalar_quantizer.py::test_dequantize_packed_at_every_width_and_row_end",
                          "tests/test_turboquant_cpu.py::test_every_row_length_of_the_register_pass_gives_the_chains_bits",
                          "-k", "not dtype1"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]



_BY_LENGTH_PROBE = """
import sys
import numpy as np
from numba import types
from schemes import hadamard_cpu

d = int(sys.argv[1])
rng = np.random.default_rng(d)
x = rng.standard_normal((5, d)).astype(np.float32)
signs = np.where(rng.random((1, d)) < 0.5, -1.0, 1.0).astype(np.float32)
args = (0, signs, signs, 5, np.float32(np.sqrt(d)), np.float32(1.0), np.empty(0, np.float32))   # rows 0..4: sign row 0
by_length, plain = np.empty_like(x), np.empty_like(x)
hadamard_cpu._hadamard_rows_by_length(x, d, *args, by_length)
hadamard_cpu._hadamard_rows(x, d, *args, plain)
ir = {str(s[1]): hadamard_cpu.transform.inspect_llvm(s) for s in hadamard_cpu.transform.signatures}
print(by_length.tobytes() == plain.tobytes())
for kind in (str(types.literal(d)), str(types.int64)):
    print(" ".join(str(n) for n in hadamard_cpu.REGISTER_ROWS if f"size.{n}:" in ir[kind]))
"""


@pytest.mark.parametrize("d", [16, 128])
def test_a_loop_called_by_length_compiles_that_length_alone_with_the_same_bits(d, tmp_path):
    """hadamard_cpu._hadamard_rows through by_length: the transform below it is compiled with d as
    a literal and holds the register code of that row length alone (by_size's block `size.<d>`),
    where the plain dispatcher's (d an int64) holds every length's; the outputs are the same bits.
    In a process of its own with an empty numba cache (cached code cannot be inspected)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    seen = subprocess.run([sys.executable, "-c", _BY_LENGTH_PROBE, str(d)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr[-3000:]
    same, literal, every = seen.stdout.splitlines()
    assert same == "True"
    assert literal == str(d)
    assert every.split() == [str(n) for n in REGISTER_ROWS]
