"""tq-kv's encode+decode throughput against public TurboQuant implementations, side by side.

    python scripts/peer_bench.py --peer tonbistudio=/path/to/turboquant-pytorch \
        [--peer 0xsero=PATH] [--peer codepawl=PATH] [--widths 1-8] [--dim 128] [--repeats 5] [--threads 2] [--json]

Each --peer names a public implementation this script knows how to call (PEERS: its repository,
the top-level package imported from PATH, and the public quantise / dequantise API of its MSE
TurboQuant — random rotation, per-coordinate Lloyd–Max codebook for the rotated coordinates, no
QJL) and the folder of a checkout of its public sources. Their code is imported from that folder,
never copied here; each is imported in isolation (PeerImport), so peers that share a package
name (most are called `turboquant`) run in one process.

Protocol, one process, --threads torch threads (default 2; kvharness's compiled loops split their
rows over the same threads):
- data: K and V caches (8, 1, 1024, d) float32, i.i.d. N(0, 1) scaled to unit rows: 2 · 8 · 1024 =
  16,384 unit vectors per encode+decode, drawn from torch's generator at DATA_SEED — not 0 or 42,
  the seeds the peers draw their rotations from by default: a Haar rotation by QR of torch.randn(d, d)
  at the data's own seed is aligned with the first d vectors, which it then codes badly (with the
  data and both Haar peers at seed 0, their MSE at b = 4 was 16 % above the Lloyd–Max value). The same two tensors serve every call, as
  inference tensors (harness.bench._unremembered): kvharness's memos never serve a repeat, so every
  call does the codec's whole work; the peers keep no memo.
- per width b: kvharness builds tq-kv at budget b (schemes.create) and codes K and V in one
  encode + decode; each peer builds its MSE quantiser at b bits once, with its own default seed
  (rotation, codebook: set-up, untimed, as kvharness's codebooks are cached) and codes K, then V,
  quantise then dequantise.
- one untimed call per side gives the mean squared error over the unit vectors, E‖x − x̂‖², to
  compare with the Lloyd–Max value for the exact Beta marginal, d · D_b
  (schemes.lloyd_max.beta_codebook(d, b).normalized_distortion): both sides code the same thing.
- timing: harness.bench._alternate (a warm-up each, then kvharness, peer 1, peer 2, ...,
  --repeats rounds), each side's figure from its fastest sample: vectors/s = 16,384 / seconds;
  ratio = kvharness vectors/s ÷ the peer's. A peer whose constructor refuses a width is reported
  as missing there, with its reason.
The load average (os.getloadavg) before and after goes beside the figures.

Bad input (unknown peer, a path without the peer's package, bad widths, ...) is one line on
stderr and exit status 2.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import harness  # noqa: E402,F401  (sets the OpenMP wait policy, as for the CLI, before torch loads)
import torch  # noqa: E402

import schemes  # noqa: E402
from harness.bench import _alternate, _unremembered  # noqa: E402
from harness.cli import _Parser  # noqa: E402
from harness.errors import UsageError  # noqa: E402
from schemes.lloyd_max import beta_codebook  # noqa: E402

KVHARNESS = "kvharness"
SCHEME = "tq-kv"
N_CACHES, SEQ_LEN = 8, 1024
MAX_WIDTH = 8
DATA_SEED = 2504_19874   # the paper's arXiv number; see the docstring for why not 0 or 42
# What a peer's constructor raises when it refuses a width: the width is missing for it.
REFUSALS = (ValueError, AssertionError, NotImplementedError)


@dataclass(frozen=True)
class Peer:
    """How to call one public implementation: repo (owner/name), the top-level package imported
    from the checkout's folder, build(package, dim, bits) -> (encode, decode) of its MSE TurboQuant
    at b bits (decode(encode(x)) reconstructs x (8, 1, 1024, d)), and the API it calls."""
    repo: str
    package: str
    build: Callable[[ModuleType, int, int], tuple[Callable, Callable]]
    api: str


def _tonbistudio(pkg: ModuleType, dim: int, bits: int):
    # V3's MSE-only compressor (its README's core block): Haar rotation by QR, Lloyd–Max codebook of
    # the N(0, 1/d) approximation, nearest centroid by argmin, bit-packed indices, float16 norms.
    c = pkg.compressors_v3.MSECompressor(dim, bits, seed=42, device="cpu")   # its TurboQuantV3's layer-0 seed
    return c.compress, c.decompress


def _0xsero(pkg: ModuleType, dim: int, bits: int):
    # Algorithm 1: Haar rotation by QR, Beta Lloyd–Max codebook (computed once and cached on disk in
    # the checkout), searchsorted on the boundaries, packed indices (b = 3 in 4-bit slots, b >= 5 bytes).
    q = pkg.quantizer.TurboQuantMSE(dim, bits, device=torch.device("cpu"))
    return q.quantize, q.dequantize


def _codepawl(pkg: ModuleType, dim: int, bits: int):
    # Randomized Hadamard rotation (torch butterflies), Lloyd–Max codebook of Beta(d/2, d/2) (its
    # tables, or computed), searchsorted, int64 codes unpacked.
    q = pkg.mse_quantizer.TurboQuantMSE(dim, bit_width=bits)
    return q.quantize, q.dequantize


PEERS: dict[str, Peer] = {
    "tonbistudio": Peer("tonbistudio/turboquant-pytorch", "turboquant", _tonbistudio,
                        "turboquant.compressors_v3.MSECompressor(d, b).compress / .decompress"),
    "0xsero": Peer("0xSero/turboquant", "turboquant", _0xsero,
                   "turboquant.quantizer.TurboQuantMSE(d, b).quantize / .dequantize"),
    "codepawl": Peer("codepawl/turboquant-torch", "turboquant", _codepawl,
                     "turboquant.mse_quantizer.TurboQuantMSE(d, b).quantize / .dequantize"),
}


def _of_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


class PeerImport:
    """A package imported from one folder and kept apart from any other of the same name: its
    modules live in sys.modules (and the folder on sys.path) only inside active(), so a peer's
    lazy imports (a function that imports a submodule) resolve to its own code. Calls that need
    no import run outside it (the timed ones: swapping modules per call would time the swap)."""

    def __init__(self, folder: Path, package: str):
        self.folder, self.package_name = str(folder), package
        self.modules: dict[str, ModuleType] = {}
        with self.active():
            self.package = __import__(package)

    @contextlib.contextmanager
    def active(self):
        others = {n: sys.modules.pop(n) for n in [n for n in sys.modules if _of_package(n, self.package_name)]}
        sys.modules.update(self.modules)
        sys.path.insert(0, self.folder)
        try:
            yield
        finally:
            sys.path.remove(self.folder)
            self.modules = {n: sys.modules.pop(n) for n in [n for n in sys.modules
                                                             if _of_package(n, self.package_name)]}
            sys.modules.update(others)


def git_commit(folder: Path) -> str | None:
    """The commit checked out in folder, or None where it is no git work tree."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def unit_caches(dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (8, 1, 1024, dim) float32, N(0, 1) rows scaled to unit length, as inference tensors."""
    g = torch.Generator().manual_seed(DATA_SEED)
    caches = {name: torch.randn(N_CACHES, 1, SEQ_LEN, dim, generator=g) for name in ("k", "v")}
    return tuple(_unremembered({name: x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
                                for name, x in caches.items()}).values())


def mean_squared_error(xs: tuple[torch.Tensor, ...], x_hats: tuple[torch.Tensor, ...]) -> float:
    """E‖x − x̂‖² over every vector (row) of the tensors, in float64."""
    errors = [((x.double() - x_hat.double().reshape(x.shape)) ** 2).sum(-1).reshape(-1) for x, x_hat in zip(xs, x_hats)]
    return float(torch.cat(errors).mean())


def side_by_side(peers: dict[str, tuple[Peer, Path]], widths: list[int], dim: int, repeats: int) -> dict:
    """Per width: vectors/s of kvharness's tq-kv and of each peer (None where the peer refuses the
    width: `missing` says why), the ratios kvharness ÷ peer and ÷ the fastest peer, each side's
    MSE on the unit vectors beside the Lloyd–Max value, and the raw samples (s)."""
    k, v = unit_caches(dim)
    n_vectors = k.shape[0] * k.shape[2] + v.shape[0] * v.shape[2]
    imports = {name: PeerImport(folder, peer.package) for name, (peer, folder) in peers.items()}
    result = {"dim": dim, "vectors": n_vectors, "threads": torch.get_num_threads(), "repeats": repeats,
              "cpu_count": os.cpu_count(), "load_average": {"before": list(os.getloadavg())},
              "peers": {name: {"repo": peer.repo, "path": str(folder), "commit": git_commit(folder), "api": peer.api}
                        for name, (peer, folder) in peers.items()},
              "widths": {}}
    for bits in widths:
        codec = schemes.create(SCHEME, budget=bits, dim=dim)
        fns = {KVHARNESS: lambda codec=codec: codec.decode(codec.encode(k, v))}
        missing: dict[str, str] = {}
        for name, (peer, _) in peers.items():
            # the peer's own code, imported and set up in its isolation; set-up messages to stderr
            with imports[name].active(), contextlib.redirect_stdout(sys.stderr):
                try:
                    encode, decode = peer.build(imports[name].package, dim, bits)
                except REFUSALS as exc:
                    missing[name] = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
                    continue
                fns[name] = lambda encode=encode, decode=decode: (decode(encode(k)), decode(encode(v)))
                fns[name]()   # any lazy import on the coding path happens here, inside active()
        mse = {name: mean_squared_error((k, v), fn()) for name, fn in fns.items()}
        samples = _alternate(fns, repeats)
        rates = {name: n_vectors / min(times) for name, times in samples.items()}
        peer_rates = {name: rates.get(name) for name in peers}
        present = [rate for rate in peer_rates.values() if rate is not None]
        result["widths"][bits] = {
            "vectors_per_s": {KVHARNESS: rates[KVHARNESS], **peer_rates},
            "ratio": {name: (rates[KVHARNESS] / rate if rate is not None else None) for name, rate in peer_rates.items()},
            "ratio_to_best_peer": rates[KVHARNESS] / max(present) if present else None,
            "missing": missing,
            "mse": {KVHARNESS: mse[KVHARNESS], **{name: mse.get(name) for name in peers}},
            "mse_lloyd_max": beta_codebook(dim, bits).normalized_distortion,
            "samples_s": samples}
    result["load_average"]["after"] = list(os.getloadavg())
    return result


def markdown(result: dict) -> str:
    """The figures as a Markdown table, with the protocol, the peers and the load above it."""
    names = list(result["peers"])
    lines = [f"{SCHEME} (kvharness) against public TurboQuant implementations: encode+decode of {result['vectors']:,} "
             f"unit vectors (K and V ({N_CACHES}, 1, {SEQ_LEN}, {result['dim']}) float32), d = {result['dim']}, "
             f"{result['threads']} torch threads, one process, fastest of {result['repeats']} alternating repeats"]
    for name, p in result["peers"].items():
        lines.append(f"- {name}: {p['repo']} at {p['commit'] or 'an unknown commit'} ({p['path']}): {p['api']}")
    header = ["b", f"{SCHEME} vectors/s"] + [f"{name} vectors/s ({SCHEME} ÷ it)" for name in names] + \
        [f"{SCHEME} ÷ fastest peer", f"MSE: {' / '.join([SCHEME] + names)} (Lloyd–Max)"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for bits, w in result["widths"].items():
        cells = [str(bits), f"{w['vectors_per_s'][KVHARNESS]:,.0f}"]
        for name in names:
            rate = w["vectors_per_s"][name]
            cells.append(f"missing ({w['missing'][name]})" if rate is None else f"{rate:,.0f} ({w['ratio'][name]:.2f}x)")
        best = w["ratio_to_best_peer"]
        cells.append("no peer" if best is None else f"{best:.2f}x")
        errors = [w["mse"][KVHARNESS]] + [w["mse"][name] for name in names]
        cells.append(" / ".join("—" if e is None else f"{e:.4g}" for e in errors) + f" ({w['mse_lloyd_max']:.4g})")
        lines.append("| " + " | ".join(cells) + " |")
    load = result["load_average"]
    lines += ["", f"load average (1, 5, 15 min) {', '.join(f'{x:.2f}' for x in load['before'])} before, "
                  f"{', '.join(f'{x:.2f}' for x in load['after'])} after ({result['cpu_count']} CPUs)"]
    return "\n".join(lines)


def parse_widths(text: str) -> list[int]:
    """'1-8', '3', '1,2,5' or '2-4,7' -> ascending distinct widths in 1..8."""
    valid = f"give widths in 1..{MAX_WIDTH} as a range (1-8), a comma list (1,2,3) or both (2-4,7)"
    widths: list[int] = []
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        if not (lo.isdigit() and lo.isascii() and (not hi or (hi.isdigit() and hi.isascii()))):
            raise UsageError(f"peer_bench: --widths {text!r} is not understood; {valid}")
        first, last = int(lo), int(hi or lo)
        if not 1 <= first <= last <= MAX_WIDTH:
            raise UsageError(f"peer_bench: --widths {text!r} has {item.strip()!r} outside 1..{MAX_WIDTH} "
                             f"or backwards; {valid}")
        widths += range(first, last + 1)
    if len(set(widths)) != len(widths):
        raise UsageError(f"peer_bench: --widths {text!r} gives a width twice; {valid}")
    return sorted(widths)


def parse_peers(items: list[str]) -> dict[str, tuple[Peer, Path]]:
    """['NAME=PATH', ...] -> {name: (its Peer, the checkout folder)}, each checked."""
    known = ", ".join(sorted(PEERS))
    peers: dict[str, tuple[Peer, Path]] = {}
    for item in items:
        name, sep, folder = item.partition("=")
        name = name.strip()
        if not sep or not name or not folder.strip():
            raise UsageError(f"peer_bench: --peer {item!r} is not NAME=PATH; known names: {known}")
        if name not in PEERS:
            raise UsageError(f"peer_bench: unknown peer {name!r}; known names: {known}")
        if name in peers:
            raise UsageError(f"peer_bench: peer {name!r} is given twice; give each peer once")
        path = Path(folder).expanduser()
        package = PEERS[name].package
        if not (path / package / "__init__.py").is_file():
            raise UsageError(f"peer_bench: --peer {name}: {str(path)!r} holds no {package}/__init__.py; give the "
                             f"folder of a checkout of {PEERS[name].repo}")
        peers[name] = (PEERS[name], path.resolve())
    return peers


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="peer_bench", description=__doc__.splitlines()[0])
    p.add_argument("--peer", action="append", default=[], metavar="NAME=PATH",
                   help=f"a public implementation and its checkout's folder (names: {', '.join(sorted(PEERS))})")
    p.add_argument("--widths", default="1-8", help="bits per coordinate: a range (1-8) or a comma list (default 1-8)")
    p.add_argument("--dim", type=int, default=128, help="head dimension d, a power of two (default 128)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each side per width (default 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    try:
        args = p.parse_args(argv)
        if not args.peer:
            raise UsageError(f"peer_bench: give at least one --peer NAME=PATH (names: {', '.join(sorted(PEERS))})")
        widths = parse_widths(args.widths)
        for flag in ("repeats", "threads"):
            if getattr(args, flag) < 1:
                raise UsageError(f"peer_bench: --{flag} must be a positive integer")
        try:
            schemes.create(SCHEME, budget=1, dim=args.dim)
        except ValueError as exc:
            raise UsageError(f"peer_bench: --dim {args.dim}: {exc}") from None
        peers = parse_peers(args.peer)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    result = side_by_side(peers, widths, args.dim, args.repeats)
    print(json.dumps(result, indent=2) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
