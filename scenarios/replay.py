"""replay:FILE — trials drawn from K, V and Q captured from a real model (`harness capture`).

A capture file holds, for L layers, Hq query heads, Hkv key/value heads, N tokens and head
dimension d: q (L, Hq, N, d), k and v (L, Hkv, N, d), and where the model has RoPE also
q_rope and k_rope (the same after the rotation, what a KV cache stores; metadata rope_dims, when
present, says how many leading coordinates of a head the rotation touches); positions (N,) and
segments (N,) (tokens of one segment were one forward pass, positions restart per segment).
Query head h reads key/value head h // (Hq / Hkv) (grouped-query attention).

Only `.safetensors` (read here with NumPy alone, so replay needs no optional package) and
`.npz` (np.load with allow_pickle=False) are loaded; pickle never is, because unpickling an
untrusted file runs its code. Every problem is one ValueError line naming the file.
"""
from __future__ import annotations

import functools
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import register
from .base import Scenario, out_of_range

CAPTURE_FORMAT = "kvharness-capture/1"
REQUIRED_METADATA = ("format", "model", "model_sha256", "layers", "heads", "kv_heads", "head_dim",
                     "n_tokens", "text_sha256", "rope")
FLOAT_TENSORS = ("q", "k", "v")
ROPE_TENSORS = ("q_rope", "k_rope")
INDEX_TENSORS = ("positions", "segments")
# safetensors dtype codes (format spec: huggingface/safetensors README) -> NumPy little-endian dtypes
_SAFETENSORS_DTYPES = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "I8": "i1", "U8": "u1", "I16": "<i2",
                       "I32": "<i4", "I64": "<i8", "BOOL": "?"}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class Capture:
    """A validated capture file. q (L, Hq, N, d); k, v (L, Hkv, N, d); q_rope, k_rope as q, k or
    None; positions, segments (N,) int64; metadata: the file's string metadata."""
    path: str
    metadata: dict
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    q_rope: np.ndarray | None
    k_rope: np.ndarray | None
    positions: np.ndarray
    segments: np.ndarray

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (1 without grouped-query attention)."""
        return self.q.shape[1] // self.k.shape[1]

    @property
    def n_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def dim(self) -> int:
        return self.k.shape[3]

    @property
    def has_rope(self) -> bool:
        return self.k_rope is not None

    @property
    def rope_dims(self) -> int:
        """How many leading coordinates of a head the RoPE rotates (metadata rope_dims; d when absent)."""
        return int(self.metadata.get("rope_dims", self.dim))


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of a .safetensors file, checked byte by byte (NumPy only).

    Layout: 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape,
    data_offsets}, "__metadata__": {str: str}}, then the tensor bytes.
    """
    raw = path.read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{path}: truncated safetensors file ({len(raw)} bytes, no header)")
    n_header = int.from_bytes(raw[:8], "little")
    if n_header > min(_MAX_HEADER_BYTES, len(raw) - 8):
        raise ValueError(f"{path}: not a safetensors file or truncated (header of {n_header} bytes, "
                         f"file of {len(raw)} bytes)")
    try:
        header = json.loads(raw[8:8 + n_header].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: __metadata__ is a JSON {type(metadata).__name__}, not an object of strings")
    data = memoryview(raw)[8 + n_header:]
    tensors = {}
    for name, entry in header.items():
        try:
            dtype = np.dtype(_SAFETENSORS_DTYPES[entry["dtype"]])
            shape = tuple(int(x) for x in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a bad header entry {entry!r} "
                             f"(valid dtypes: {', '.join(_SAFETENSORS_DTYPES)})") from None
        if end > len(data):
            raise ValueError(f"{path}: truncated file: tensor {name!r} ends at byte {end} of the data, "
                             f"which has {len(data)} bytes")
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0 or min(shape, default=1) < 0:
            raise ValueError(f"{path}: tensor {name!r} of shape {shape} and dtype {entry['dtype']} "
                             f"does not fit its {end - begin} bytes")
        tensors[name] = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of a .npz capture (metadata: a JSON string in the array `metadata`)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            tensors = {name: archive[name] for name in archive.files}
    except ValueError as exc:  # object arrays need pickle, which is refused
        raise ValueError(f"{path}: refused: {str(exc).splitlines()[0]} (only plain numeric arrays are "
                         f"loaded, never pickle)") from None
    except PermissionError:
        raise   # load_capture: "cannot be read", not "not an archive"
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz archive or truncated ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
    other = [name for name, x in tensors.items() if not isinstance(x, np.ndarray)]
    if other:   # np.load hands a member that is not .npy over as its raw bytes
        raise ValueError(f"{path}: member {other[0]!r} is not a .npy array; a capture .npz holds only .npy members")
    meta = tensors.pop("metadata", None)
    if meta is None or meta.dtype.kind != "U" or meta.ndim != 0:
        raise ValueError(f"{path}: missing metadata (a 0-d string array 'metadata' holding a JSON object)")
    try:
        metadata = json.loads(str(meta))
    except json.JSONDecodeError:
        raise ValueError(f"{path}: metadata is not JSON") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: metadata is a JSON {type(metadata).__name__}, not an object")
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _check(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> Capture:
    if metadata.get("format") != CAPTURE_FORMAT:
        raise ValueError(f"{path}: metadata format is {metadata.get('format')!r}, expected {CAPTURE_FORMAT!r}")
    missing = [key for key in REQUIRED_METADATA if key not in metadata]
    if missing:
        raise ValueError(f"{path}: missing metadata key(s) {', '.join(missing)}")
    if metadata["rope"] not in ("yes", "no"):
        raise ValueError(f"{path}: metadata rope={metadata['rope']!r}; valid: yes, no")
    rope = metadata["rope"] == "yes"
    names = FLOAT_TENSORS + (ROPE_TENSORS if rope else ()) + INDEX_TENSORS
    absent = [n for n in names if n not in tensors]
    if absent:
        raise ValueError(f"{path}: missing tensor(s) {', '.join(absent)}")
    for name in names:
        kind = tensors[name].dtype.kind
        if name in INDEX_TENSORS and kind not in "iu":
            raise ValueError(f"{path}: tensor {name} has dtype {tensors[name].dtype}; valid: integer")
        if name not in INDEX_TENSORS and tensors[name].dtype not in (np.float16, np.float32, np.float64):
            raise ValueError(f"{path}: tensor {name} has dtype {tensors[name].dtype}; valid: float16, float32, float64")
    q, k, v = (tensors[n] for n in FLOAT_TENSORS)
    if k.ndim != 4 or q.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{path}: wrong shapes q {q.shape}, k {k.shape}, v {v.shape}; expected "
                         f"q (L, Hq, N, d) and k, v (L, Hkv, N, d)")
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(f"{path}: empty capture: q {q.shape}, k {k.shape} hold no layer, head, token or dimension "
                         f"along some axis; capture at least one of each")
    n_layers, n_kv, n_tokens, dim = k.shape
    if q.shape[0] != n_layers or q.shape[2:] != (n_tokens, dim) or n_kv < 1 or q.shape[1] % n_kv:
        raise ValueError(f"{path}: wrong shapes q {q.shape}, k {k.shape}: layers, tokens and head_dim must "
                         f"agree and query heads be a multiple of key/value heads")
    if rope and (tensors["q_rope"].shape != q.shape or tensors["k_rope"].shape != k.shape):
        raise ValueError(f"{path}: wrong shapes q_rope {tensors['q_rope'].shape}, k_rope {tensors['k_rope'].shape}; "
                         f"expected those of q {q.shape} and k {k.shape}")
    for name in INDEX_TENSORS:
        if tensors[name].shape != (n_tokens,):
            raise ValueError(f"{path}: tensor {name} has shape {tensors[name].shape}; expected ({n_tokens},)")
    if np.any(np.diff(tensors["segments"]) < 0):
        raise ValueError(f"{path}: segments must be non-decreasing")
    overlap = overlapping_windows(tensors["positions"], tensors["segments"])
    if overlap is not None:
        raise ValueError(f"{path}: {overlap}")
    expected = {"layers": n_layers, "heads": q.shape[1], "kv_heads": n_kv, "head_dim": dim, "n_tokens": n_tokens}
    for key, value in expected.items():
        if metadata[key] != str(value):
            raise ValueError(f"{path}: metadata {key}={metadata[key]!r} disagrees with the tensors ({value})")
    rotated = metadata.get("rope_dims", str(dim))
    if not (rotated.isdigit() and 2 <= int(rotated) <= dim and int(rotated) % 2 == 0):
        raise ValueError(f"{path}: metadata rope_dims={rotated!r}; valid: an even number of rotated coordinates in "
                         f"[2, head_dim {dim}]")
    for name in names:
        if name not in INDEX_TENSORS and not np.all(np.isfinite(tensors[name])):
            raise ValueError(f"{path}: tensor {name} holds NaN or Inf")
    # Finite is not enough: the metrics square the values and sum them over a window's S·d entries
    # in the run's dtype, so a file scaled by 1e30 (float32) or 1e300 (float64) overflows them to
    # inf, and one scaled by 1e-320 (subnormal) underflows them to 0 (rel_mse 0/0 stored as 0).
    # The bound is carried_range's at the longest window the file holds, S = N: float32's, the
    # narrowest dtype a run computes in, so the file serves either --dtype.
    wrong = out_of_range({f"tensor {n}": tensors[n] for n in names if n not in INDEX_TENSORS}, n_tokens * dim)
    if wrong is not None:
        raise ValueError(f"{path}: {wrong[2]}; rescale the capture into that range")
    return Capture(str(path), dict(metadata), q, k, v, tensors.get("q_rope") if rope else None,
                   tensors.get("k_rope") if rope else None, tensors["positions"].astype(np.int64),
                   tensors["segments"].astype(np.int64))


def overlapping_windows(positions: np.ndarray, segments: np.ndarray) -> str | None:
    """Why the tokens are not one window of consecutive positions per segment (p, p+1, ... in each
    forward pass), or None. A position that repeats or steps back inside a segment is a second
    window overlapping the first, joined to it under one segment number: a replayed window could
    span both (tokens that never attended to each other, one token twice) and the calibration
    part could share tokens with the evaluated one."""
    positions, segments = positions.astype(np.int64), segments.astype(np.int64)
    if positions.size and positions.min() < 0:
        i = int(np.argmin(positions))
        return f"position {int(positions[i])} at token {i} is negative; valid: positions 0, 1, ... within each segment"
    same = segments[1:] == segments[:-1]
    step = np.diff(positions)
    wrong = np.flatnonzero(same & (step != 1))
    if not wrong.size:
        return None
    i = int(wrong[0]) + 1
    what = "overlapping windows" if step[i - 1] < 1 else "a gap"
    return (f"{what} in segment {int(segments[i])}: token {i} is at position {int(positions[i])} after position "
            f"{int(positions[i - 1])}; valid: consecutive positions (p, p+1, ...) within each segment, one "
            f"non-overlapping window (forward pass) per segment number")


def load_capture(path: str | Path) -> Capture:
    """The validated capture at `path` (.safetensors or .npz); ValueError naming the file and problem."""
    path = Path(path)
    if path.suffix not in (".safetensors", ".npz"):
        raise ValueError(f"{path}: only .safetensors and .npz capture files are loaded (never pickle); "
                         f"got {path.suffix or 'no suffix'!r}")
    if not path.is_file():
        raise ValueError(f"{path}: no such capture file")
    try:
        stat = path.stat()
        return _load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except OSError as exc:   # permission denied, an I/O error: one line too
        raise ValueError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__}); give a capture file "
                         f"you may read") from None


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, mtime_ns: int, size: int) -> Capture:
    """Cached by (path, mtime, size): a sweep draws every trial from the same file."""
    reader = read_safetensors if path.endswith(".safetensors") else read_npz
    return _check(Path(path), *reader(Path(path)))


@register
@dataclass(frozen=True)
class Replay(Scenario):
    """Trials from a captured file. Per trial: `shape.n_heads` key/value heads of `layer`
    (heads="random": drawn without replacement per trial; "first": heads 0..H-1); a random
    window of S consecutive tokens from one segment of the evaluation part (the tokens after
    the first `calib_fraction` of the file; window="random": any start, "disjoint": starts on a
    grid of step S per segment, so two trials' windows coincide or do not overlap); Nq real queries, the captured Q at tokens drawn
    from the window, of a query head that reads the key head (a random one of its GQA group);
    calibration: n_cal tokens of the same heads drawn from the calibration part (the first
    `calib_fraction` of the file, disjoint from every window; with replacement only when that
    part holds fewer than n_cal tokens). rope="post" (default) replays keys and queries after
    RoPE, as a cache stores them; "pre" before it; models without RoPE have one version.
    layer=-1 means the middle layer L // 2. part="first" / "second": windows only inside the
    first / second half of the evaluation part (tokens [split, mid) / [mid, N), mid their middle),
    so that a choice made on one half can be judged on tokens it never saw (harness recommend);
    "all" (default): the whole evaluation part. `temperature` is unused: queries are real; so is
    `drift`: replay has no decode tokens.
    """
    name = "replay"
    description = "K, V and real queries captured from a model (harness capture), calibration from a disjoint part"
    parametric = True
    source_hint = "FILE"
    source: str = ""
    layer: int = -1
    heads: str = "random"
    window: str = "random"
    calib_fraction: float = 0.5
    rope: str = "post"
    part: str = "all"

    def validate(self) -> None:
        if not self.source:
            raise ValueError("scenario replay: give the capture file as replay:FILE")
        if self.heads not in ("random", "first"):
            raise ValueError(f"scenario replay: heads={self.heads!r}; valid: random, first")
        if self.window not in ("random", "disjoint"):
            raise ValueError(f"scenario replay: window={self.window!r}; valid: random, disjoint")
        if self.part not in ("all", "first", "second"):
            raise ValueError(f"scenario replay: part={self.part!r}; valid: all, first, second")
        if self.rope not in ("post", "pre"):
            raise ValueError(f"scenario replay: rope={self.rope!r}; valid: post, pre")
        if not 0 < self.calib_fraction < 1:
            raise ValueError(f"scenario replay: calib_fraction={self.calib_fraction} must lie in (0, 1)")
        capture = load_capture(self.source)
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or not -1 <= self.layer < capture.n_layers:
            raise ValueError(f"scenario replay: layer={self.layer!r}; valid: -1 (middle) or 0..{capture.n_layers - 1}")

    def capture(self) -> Capture:
        return load_capture(self.source)

    def layer_index(self, capture: Capture) -> int:
        return capture.n_layers // 2 if self.layer == -1 else self.layer

    def split(self, capture: Capture) -> int:
        """The first evaluation token: tokens [0, split) calibrate, [split, N) are replayed."""
        return int(capture.n_tokens * self.calib_fraction)

    def window_starts(self, capture: Capture, seq_len: int) -> np.ndarray:
        """Starts s of the evaluation windows [s, s + S): inside the evaluation part and one segment."""
        split, end = self.split(capture), capture.n_tokens
        mid = (split + end) // 2
        if self.part != "all":
            split, end = (split, mid) if self.part == "first" else (mid, end)
        starts = np.arange(split, end - seq_len + 1)
        starts = starts[capture.segments[starts] == capture.segments[starts + seq_len - 1]]
        if self.window == "disjoint" and starts.size:  # a grid of step S from each segment's first start
            _, first, which = np.unique(capture.segments[starts], return_index=True, return_inverse=True)
            starts = starts[(starts - starts[first][which]) % seq_len == 0]
        return starts

    def check_shape(self, shape) -> np.ndarray:
        """The window starts for `shape`, or ValueError (one line naming the file) when the file cannot
        serve it: another head_dim, more heads than it has, no window of S tokens, no calibration token.
        A sweep can call this before it starts (every draw calls it too). Decode tokens are refused:
        the tokens after a window would change which windows fit, so the prefill draw would depend on N."""
        if shape.n_decode:
            raise ValueError("replay: --decode-tokens is not supported")
        cap = self.capture()
        if cap.dim != shape.dim:
            raise ValueError(f"{cap.path}: head_dim in file is {cap.dim}, requested dim {shape.dim}")
        if shape.n_heads > cap.n_kv_heads:
            raise ValueError(f"{cap.path}: {shape.n_heads} heads requested, the file has {cap.n_kv_heads} "
                             f"key/value heads")
        if self.split(cap) < 1:
            raise ValueError(f"{cap.path}: calib_fraction={self.calib_fraction} leaves no calibration token "
                             f"of {cap.n_tokens}")
        starts = self.window_starts(cap, shape.seq_len)
        if starts.size == 0:
            raise ValueError(f"{cap.path}: no window of {shape.seq_len} consecutive tokens within one segment "
                             f"after the calibration part ({cap.n_tokens - self.split(cap)} tokens); lower "
                             f"--seq-len or capture more tokens")
        return starts

    def draw(self, streams, shape):
        """One trial, float64: k, v (H, S, d); q (H, Nq, d); k_cal, v_cal (H, n_cal, d); positions (S,);
        with shape.prefill_queries also q_prefill (H, S, d), the window tokens' own queries."""
        cap = self.capture()
        h, s = shape.n_heads, shape.seq_len
        starts = self.check_shape(shape)
        layer = self.layer_index(cap)
        post = self.rope == "post" and cap.has_rope
        keys = cap.k_rope if post else cap.k
        queries = cap.q_rope if post else cap.q
        if self.heads == "random":
            heads = streams("heads").choice(cap.n_kv_heads, size=h, replace=False)
        else:
            heads = np.arange(h)
        start = int(streams("window").choice(starts))
        window = slice(start, start + s)
        n_cal, n_avail = shape.n_calib, self.split(cap)
        out = {"k": np.empty((h, s, cap.dim)), "v": np.empty((h, s, cap.dim)),
               "q": np.empty((h, shape.n_queries, cap.dim)),
               "k_cal": np.empty((h, n_cal, cap.dim)), "v_cal": np.empty((h, n_cal, cap.dim))}
        for i, head in enumerate(heads):
            out["k"][i] = keys[layer, head, window]
            out["v"][i] = cap.v[layer, head, window]
            query_head = head * cap.group_size + streams("query_head", i).integers(cap.group_size)
            tokens = streams("queries", i).choice(s, size=shape.n_queries, replace=shape.n_queries > s)
            out["q"][i] = queries[layer, query_head, start + tokens]
            if shape.prefill_queries:   # the window's own queries (the query head of the evaluated ones)
                out.setdefault("q_prefill", np.empty((h, s, cap.dim)))[i] = queries[layer, query_head, window]
            cal = streams("calibration", i).choice(n_avail, size=n_cal, replace=n_cal > n_avail)
            out["k_cal"][i] = keys[layer, head, cal]
            out["v_cal"][i] = cap.v[layer, head, cal]
        out["positions"] = cap.positions[window].copy()
        return out
