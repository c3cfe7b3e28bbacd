"""Conformance checks for a KV-cache codec, shipped for plug-in authors (in the spirit of
scikit-learn's `check_estimator`).

A check takes a *factory*: a callable `make(budget=, dim=, seed=, **options)` that returns a
scheme (schemes/base.py), the signature of a registered factory. Every check builds its codecs
through schemes.registry.build, as the sweep does (budget, dim and seed checked, the RNG family
set, validate called), and calls them as the sweep does (schemes.base.fit_codec with the trial
indices, encode_codec with the tokens' positions and prefill queries, each where the codec
declares it takes them): a factory that passes the checks runs in a sweep. Any of these will do:

    functools.partial(schemes.create, "tq-kv")                  # a registered codec
    functools.partial(schemes.create, "tq-kv", impl="reference")  # its NumPy reference
    functools.partial(MyCodec, group=32)                        # an unregistered class, configured
    functools.partial(schemes.create, "kvpress:SnapKVPress", window_size=8)

`check_scheme(factory)` runs every check and raises ConformanceError listing each failure as a
sentence; `CHECKS` holds them one by one (name, function, what it states) for a test runner, and
`pytest_params(factories)` turns a {label: factory} mapping into pytest parameters.

The data are small and seeded (B = 3 trials, H = 2 heads, S = 48 tokens, d = 64 unless the
factory is asked for another dim), so a codec whose defaults need a longer cache takes smaller
options in its factory. Applicability is by capability, not by name: a check skips the budgets a
factory refuses (ValueError at construction), `kept` is checked where the codec evicts, and what
a codec takes beyond the plain protocol it gets where it declares it (Scheme.capabilities).
"""
from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import pickle
import selectors
import subprocess
import sys
import time
from typing import Callable

import torch

from kvcommon.checks import Check, ConformanceError, require, run_checks
from kvcommon.rows import METRIC_NAMES

from .base import BitLedger, Encoded, encode_codec, entry_bits, fit_codec
from .registry import MAX_BUDGET, MIN_BUDGET, build, create, spec

Factory = Callable[..., object]

DIM = 64
SHAPE = (3, 2, 48, DIM)          # B, H, S, d
N_QUERIES = 5
BUDGET = 3


RNG = "pcg64"                    # the sweep's default --rng, set on every codec built here


def _make(factory: Factory, budget: int = BUDGET, seed: int = 0, dim: int = DIM):
    """The factory's codec, built as the sweep builds it (schemes.registry.build)."""
    return build(factory, budget=budget, dim=dim, seed=seed, rng=RNG)


def _encode(scheme, k: torch.Tensor, v: torch.Tensor) -> Encoded:
    """encode as the sweep calls it: the tokens' positions 0..S−1, and as the cached tokens' own
    queries the keys scaled to unit length (a trial's, of the scale the sweep's queries have,
    whatever the keys' magnitude), each where the codec declares it takes them."""
    return encode_codec(scheme, k, v, torch.arange(k.shape[2], device=k.device), torch.nn.functional.normalize(k, dim=-1))


def _data(seed: int = 0, shape=SHAPE, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g, dtype=dtype)
    v = torch.randn(shape, generator=g, dtype=dtype)
    q = torch.randn(shape[:2] + (N_QUERIES, shape[3]), generator=g, dtype=dtype)
    return k, v, q


def _roundtrip(scheme, k, v, trials=None):
    """fit (on k, v), encode and decode, as the sweep calls them; trials: the trial indices
    (0..B−1 when None), for a fit that declares it takes them."""
    fit_codec(scheme, k, v, torch.arange(len(k)) if trials is None else trials)
    enc = _encode(scheme, k, v)
    return enc, scheme.decode(enc)


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def encoding_bytes(enc: Encoded) -> bytes:
    """enc as a deployment stores it: its tensors and tables written to bytes (torch.save)."""
    buffer = io.BytesIO()
    torch.save({"shape": list(enc.shape), "dtype": str(enc.dtype).removeprefix("torch."), "codes": enc.codes,
                "side": enc.side, "exact_bits": enc.exact_bits, "model": sorted(enc.model)}, buffer)
    return buffer.getvalue()


def encoding_from_bytes(stored: bytes) -> Encoded:
    """An Encoded read back from encoding_bytes, sharing nothing with the encoder's objects."""
    data = torch.load(io.BytesIO(stored), weights_only=True)
    return Encoded(tuple(data["shape"]), getattr(torch, data["dtype"]), data["codes"], data["side"],
                   data["exact_bits"], set(data["model"]))


def stored_copy(enc: Encoded) -> Encoded:
    """enc as a deployment would store and load it (encoding_bytes, encoding_from_bytes)."""
    return encoding_from_bytes(encoding_bytes(enc))


# The packages of this repository: their codecs and scenarios are checked in the sweep's own process; any other
# code (an entry-point plug-in) decodes its stored bytes in a separate process (decode_elsewhere).
PROJECT_PACKAGES = ("schemes", "scenarios", "harness")
N_DECODES = 2    # a decoder must be a function of its input: the stored bytes are decoded twice


def in_project(obj) -> bool:
    """Whether obj's class is this repository's code (PROJECT_PACKAGES), not a plug-in's."""
    return type(obj).__module__.partition(".")[0] in PROJECT_PACKAGES


def _decodings(scheme, stored: bytes, q: torch.Tensor | None) -> list[tuple]:
    """N_DECODES decodings (k̂, v̂, and the score of q where the codec scores on its codes) of the
    stored bytes by `scheme`, each from its own copy."""
    out = []
    for _ in range(N_DECODES):
        copy = encoding_from_bytes(stored)
        decoded = tuple(scheme.decode(copy))
        if q is not None and scheme.capabilities.scores_on_codes:
            decoded += (scheme.score(q, copy),)
        out.append(decoded)
    return out


_CANNOT_DECODE = ("a new instance, built and fitted as the encoder, cannot decode the stored encoding ({}): the "
                  "codec decodes from something the encoding does not hold")


def decode_here(fresh, enc: Encoded, q: torch.Tensor | None = None) -> list[tuple]:
    """The stored bytes of enc decoded N_DECODES times by `fresh`, a new instance built and fitted
    as the encoder was, in this process (this repository's codecs)."""
    try:
        return _decodings(fresh, encoding_bytes(enc), q)
    except Exception as exc:  # noqa: BLE001 - the codec's own failure, said as the property it breaks
        raise ConformanceError(_CANNOT_DECODE.format(f"{type(exc).__name__}: {exc}")) from None


def decode_elsewhere(factory: Factory, build_options: dict, fit_data: tuple, enc: Encoded,
                     q: torch.Tensor | None = None) -> list[tuple]:
    """The stored bytes of enc decoded N_DECODES times in a separate Python process (_Decoder) by a
    new instance, build(factory, **build_options), fitted on fit_data = (k_cal, v_cal, trials) as
    the encoder was: nothing of the encoder's process (module-level state, caches keyed by an id in
    the codes) reaches it. The factory travels by reference (pickle), as an installed plug-in's
    entry point names it; ConformanceError where it cannot, or where the decoding fails."""
    buffer = io.BytesIO()
    try:
        torch.save({"factory": _importable(factory), "options": build_options, "fit": fit_data,
                    "stored": encoding_bytes(enc), "q": q}, buffer)
    except Exception as exc:  # noqa: BLE001 - pickling a local class or an unpicklable option
        raise ConformanceError(f"the codec's factory cannot be handed to a separate process by reference "
                               f"({type(exc).__name__}: {exc}): a plug-in's stored bytes are decoded there, "
                               f"so its factory must be importable by name") from None
    answer = torch.load(io.BytesIO(_DECODER.ask(buffer.getvalue())), weights_only=True)
    if "error" in answer:
        raise ConformanceError(_CANNOT_DECODE.format(answer["error"]))
    return answer["decodings"]


def _importable(factory: Factory) -> Factory:
    """factory as the other process can import it: `partial(schemes.create, name, ...)` becomes the
    registered name's own factory (this process's registry may list plug-ins the other's cannot)."""
    if isinstance(factory, functools.partial) and factory.func is create and factory.args:
        found = spec(factory.args[0])
        if found is not None:
            return functools.partial(found.factory, *factory.args[1:], **factory.keywords)
    return factory


# How long the separate decoding process may take to answer (seconds): a codec whose decode
# hangs there fails its cell instead of stopping the sweep; a generous bound, far above any
# decoding of one trial, that the variable raises for a slow device or codec.
DECODE_TIMEOUT_ENV = "KVHARNESS_DECODE_TIMEOUT_S"
DECODE_TIMEOUT_S = 600.0


def decode_timeout_s() -> float:
    """The limit in seconds: the variable's positive value (inf: none), else DECODE_TIMEOUT_S."""
    try:
        value = float(os.environ.get(DECODE_TIMEOUT_ENV, DECODE_TIMEOUT_S))
    except ValueError:
        return DECODE_TIMEOUT_S
    return value if value > 0 else DECODE_TIMEOUT_S


def _read_within(fd: int, n: int, deadline: float) -> bytes | None:
    """n bytes from the file descriptor, None at its end; TimeoutError once time.monotonic()
    passes deadline (inf: never)."""
    chunks, left = [], n
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while left:
            wait = None if math.isinf(deadline) else deadline - time.monotonic()
            if (wait is not None and wait <= 0) or not selector.select(wait):
                raise TimeoutError
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)


def _unframe_within(fd: int, deadline: float) -> bytes | None:
    """_unframe from a raw descriptor, by a deadline (_read_within)."""
    header = _read_within(fd, 8, deadline)
    return None if header is None else _read_within(fd, int.from_bytes(header, "little"), deadline)


def _frame(stream, payload: bytes) -> None:
    stream.write(len(payload).to_bytes(8, "little") + payload)
    stream.flush()


def _unframe(stream) -> bytes | None:
    header = stream.read(8)
    return stream.read(int.from_bytes(header, "little")) if len(header) == 8 else None


class _Decoder:
    """The separate process of decode_elsewhere: started on first use and kept for the sweep, so a
    plug-in is imported there once. It only ever builds, fits and decodes, never encodes: no
    encoder's state is ever in it. Requests and answers are length-prefixed bytes on its stdin and
    stdout (what a plug-in prints goes to its stderr)."""

    def __init__(self):
        self.process: subprocess.Popen | None = None

    def ask(self, request: bytes) -> bytes:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-c", _CHILD],      # -P: the modules on the path given, not the cwd's
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        limit = decode_timeout_s()
        try:
            _frame(self.process.stdin, pickle.dumps({"path": [p for p in sys.path if p], "request": request}))
            answer = _unframe_within(self.process.stdout.fileno(), time.monotonic() + limit)
        except TimeoutError:
            self._stop()
            raise ConformanceError(f"the separate process decoding the stored encoding gave no answer in {limit:g} s "
                                   f"(the codec's fit or decode does not return; {DECODE_TIMEOUT_ENV} sets the "
                                   f"limit)") from None
        except OSError:
            answer = None
        except BaseException:   # its answer unread: never read as the next request's
            self._stop()
            raise
        if answer is None:
            self._stop()
            raise ConformanceError("the separate process decoding the stored encoding died (the codec crashed it)")
        return answer

    def _stop(self) -> None:
        """The process ended and its pipes closed; the next request starts another."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                with contextlib.suppress(OSError):
                    stream.close()
        self.process = None


_DECODER = _Decoder()
# The answers go to the process's original stdout; anything printed (on import, by a plug-in) to stderr.
_CHILD = ("import os; answers = os.fdopen(os.dup(1), 'wb'); os.dup2(2, 1); "
          "from schemes.conformance import _decode_child; _decode_child(answers)")


def _decode_child(answers) -> None:
    """_Decoder's process: answer each request (build, fit, decode) on `answers` with the
    decodings, or the error in words, until its stdin closes."""
    while (message := _unframe(sys.stdin.buffer)) is not None:
        message = pickle.loads(message)
        sys.path.extend(p for p in message["path"] if p not in sys.path)
        try:
            request = torch.load(io.BytesIO(message["request"]), weights_only=False)
            scheme = build(request["factory"], **request["options"])
            fit_codec(scheme, *request["fit"])
            answer = {"decodings": _decodings(scheme, request["stored"], request["q"])}
        except Exception as exc:  # noqa: BLE001 - reported to the sweep as the codec's failure
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        buffer = io.BytesIO()
        torch.save(answer, buffer)
        _frame(answers, buffer.getvalue())


def require_standalone(enc: Encoded, reference: tuple, decodings: list[tuple]) -> None:
    """The encoding of one trial stands alone (ConformanceError where it does not): its ledger
    counts the bits its tensors occupy (a trial coded alone has no padding, so its exact bits are
    its stored bits), and each of `decodings`, made from its stored bytes by a new instance built
    and fitted as the encoder was (decode_here, decode_elsewhere), is reference = (k̂, v̂[, logits])
    the encoder decoded, exactly: the same every time, with the input's shape and dtype."""
    ledger, stored = BitLedger.per_trial(enc), BitLedger.of(enc)
    require(enc.n_trials == 1, f"require_standalone takes the encoding of one trial, not {enc.n_trials}")
    require(float(ledger.cache[0]) == stored.total and float(ledger.model[0]) == stored.model_total,
             f"a trial coded alone is charged {float(ledger.cache[0]):.0f} per-cache and {float(ledger.model[0]):.0f} "
             f"per-model bits, but its stored tensors occupy {stored.total} and {stored.model_total} (exact_bits may "
             f"only leave out the padding of a batch)")
    for n, decoded in enumerate(decodings, 1):
        for what, x, x_ref in zip(("K", "V", "the logits"), decoded, reference):
            same = x.shape == x_ref.shape and x.dtype == x_ref.dtype and torch.equal(x, x_ref)
            require(same, f"a new instance, built and fitted as the encoder, {'scores' if what == 'the logits' else 'decodes'}"
                          f" the stored encoding to another {what} (decoding {n} of {len(decodings)}; by up to "
                          f"{_largest(x - x_ref) if x.shape == x_ref.shape else math.inf:.3g}): the codec decodes from "
                          f"something the encoding does not hold, or not as a function of it")


def require_encoding_of(enc: Encoded, k: torch.Tensor, v: torch.Tensor) -> None:
    """enc codes k and v: Encoded.shape and dtype are theirs (the ledger divides by the shape), and
    every codes entry has one slice per trial (the ledger charges a trial its slice)."""
    require(tuple(k.shape) == tuple(v.shape), f"K {tuple(k.shape)} and V {tuple(v.shape)} differ in shape")
    require(tuple(enc.shape) == tuple(k.shape) and enc.dtype == k.dtype,
             f"the encoding claims shape {tuple(enc.shape)} and dtype {enc.dtype} for K and V of shape "
             f"{tuple(k.shape)} and dtype {k.dtype}")
    for key, t in enc.codes.items():
        require(t.dim() > 0 and t.shape[0] == k.shape[0],
                 f"codes.{key} has shape {tuple(t.shape)}, not one slice per trial ({k.shape[0]})")


def require_scored(logits: torch.Tensor, kept: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
    """The codec's logits are (B, H, Nq, S) and its kept mask, where it evicts, bool (B, H, S)."""
    expected = (*q.shape[:3], k.shape[2])
    require(tuple(logits.shape) == expected, f"the logits have shape {tuple(logits.shape)}, not (B, H, Nq, S) = "
                                             f"{expected}")
    require(kept is None or (kept.dtype == torch.bool and tuple(kept.shape) == tuple(k.shape[:3])),
             f"kept() returns {getattr(kept, 'dtype', None)} of shape {tuple(getattr(kept, 'shape', ()))}, not bool "
             f"of shape (B, H, S) = {tuple(k.shape[:3])}")


def require_decoded(decoded: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
    """decode returned K and V of exactly the input's shape, dtype and device (nothing broadcast)."""
    require(len(decoded) == 2, f"decode returned {len(decoded)} tensors, not (K, V)")
    for what, x_hat, x in (("K", decoded[0], k), ("V", decoded[1], v)):
        require(isinstance(x_hat, torch.Tensor) and x_hat.shape == x.shape and x_hat.dtype == x.dtype
                 and x_hat.device == x.device,
                 f"decode returned {what} as {getattr(x_hat, 'dtype', type(x_hat).__name__)} of shape "
                 f"{tuple(getattr(x_hat, 'shape', ()))} for an input {x.dtype} of shape {tuple(x.shape)} on {x.device}")


# --- the checks ------------------------------------------------------------------------------
def check_roundtrip_keeps_shape_dtype_device(factory: Factory) -> None:
    """decode returns K and V of the input's shape, dtype and device, in float32 and float64."""
    for dtype in (torch.float32, torch.float64):
        k, v, _ = _data(dtype=dtype)
        _, (k_hat, v_hat) = _roundtrip(_make(factory), k, v)
        for what, x, x_hat in (("K", k, k_hat), ("V", v, v_hat)):
            require(x_hat.shape == x.shape, f"decode returns {what} of shape {tuple(x_hat.shape)} for a "
                                             f"{dtype} input of shape {tuple(x.shape)}")
            require(x_hat.dtype == x.dtype, f"decode returns {what} as {x_hat.dtype} for a {dtype} input")
            require(x_hat.device == x.device, f"decode returns {what} on {x_hat.device} for an input on {x.device}")


def check_same_seed_same_codes(factory: Factory) -> None:
    """Two schemes built with one seed store identical codes and side data for one cache."""
    k, v, _ = _data()
    enc_a, _ = _roundtrip(_make(factory, seed=7), k, v)
    enc_b, _ = _roundtrip(_make(factory, seed=7), k, v)
    for part in ("codes", "side"):
        a, b = getattr(enc_a, part), getattr(enc_b, part)
        require(a.keys() == b.keys(), f"two schemes with seed 7 store different {part} entries: "
                                       f"{sorted(a.keys() ^ b.keys())}")
        for key in a:
            require(torch.equal(a[key], b[key]), f"{part}.{key} differs between two schemes built with seed 7")


def check_input_not_mutated(factory: Factory) -> None:
    """fit, encode, decode and score leave k, v and q as they were."""
    k, v, q = _data()
    k0, v0, q0 = k.clone(), v.clone(), q.clone()
    scheme = _make(factory)
    enc, _ = _roundtrip(scheme, k, v)
    scheme.score(q, enc)
    for what, x, x0 in (("k", k, k0), ("v", v, v0), ("q", q, q0)):
        require(torch.equal(x, x0), f"the scheme changed its input {what} in place (largest change "
                                     f"{_largest(x - x0):.3g})")


def check_ledger_matches_storage(factory: Factory) -> None:
    """bits() counts exactly the stored tensors (as serialized: schemes.base.entry_bits), split into per-cache and per-model parts that add
    up to the stand-alone total, with no per-trial tensor held at full width."""
    k, v, _ = _data()
    scheme = _make(factory)
    enc, _ = _roundtrip(scheme, k, v)
    ledger = scheme.bits(enc)
    b, h, s, d = SHAPE
    every = {(part, key): bits // b if part == "codes" else bits for (part, key), bits in entry_bits(enc).items()}
    stray = enc.model - (enc.codes.keys() | enc.side.keys())
    require(not stray, f"Encoded.model names entries that are not stored: {sorted(stray)}")
    model = sum(bits for (_, key), bits in every.items() if key in enc.model)
    require(ledger.total == sum(every.values()) - model,
             f"the per-cache ledger counts {ledger.total} bits but the stored per-cache tensors hold "
             f"{sum(every.values()) - model}")
    require(ledger.model_total == model, f"the per-model ledger counts {ledger.model_total} bits but the "
                                          f"entries tagged per model hold {model}")
    require(ledger == BitLedger.of(enc), "bits(enc) differs from BitLedger.of(enc), the count of what is stored")
    require(ledger.n_elements == 2 * h * s * d and ledger.n_heads == h,
             f"the ledger counts {ledger.n_elements} elements and {ledger.n_heads} heads for a cache of "
             f"{2 * h * s * d} elements (K and V) and {h} heads")
    per_trial = BitLedger.per_trial(enc)
    require(per_trial.cache.shape == per_trial.model.shape == (b,),
             f"per-trial bits have shape {tuple(per_trial.cache.shape)}, not one entry per trial ({b},)")
    require((per_trial.cache <= ledger.total).all() and (per_trial.model <= ledger.model_total).all(),
             "a trial's exact bit count exceeds the batch's padded count")
    for key, t in enc.codes.items():
        require(t.shape[0] == b, f"codes.{key} lacks the leading trial dimension (shape {tuple(t.shape)}, "
                                  f"{b} trials)")
        if t.is_floating_point():
            require(t[0].numel() < h * s * d, f"codes.{key} stores a full-size float tensor per trial")
    require(0 < ledger.bits_per_element < 32,
             f"{ledger.bits_per_element:.3g} bits per element is not a compression of float32")


def check_encoding_stands_alone(factory: Factory) -> None:
    """A trial's encoding, stored as bytes and loaded, decodes and scores on a new instance
    (built and fitted as the encoder: per-model constants are shared) exactly as the encoder
    decodes it, twice, after the encoder has coded another cache (a plug-in's in a separate
    process, where no module-level state of the encoder's reaches); coded alone, its ledger is the bits
    its tensors occupy, and in a batch it is charged the same."""
    k_cal, v_cal, _ = _data(5)
    k, v, q = _data(0)

    def fitted(trials: torch.Tensor):
        scheme = _make(factory)
        fit_codec(scheme, k_cal[trials], v_cal[trials], trials)
        return scheme

    one = torch.tensor([1])
    first = fitted(one)
    enc = _encode(first, k[one], v[one])
    reference = tuple(first.decode(enc)) + ((first.score(q[one], enc),) if first.capabilities.scores_on_codes else ())
    _encode(first, -2 * k[:1], v[:1])        # a decoder reading what its encoder saw last now reads this
    if in_project(first):
        decodings = decode_here(fitted(one), enc, q[one])
    else:                                    # a plug-in: where no state of its encoder's process reaches
        decodings = decode_elsewhere(factory, dict(budget=BUDGET, dim=DIM, seed=0, rng=RNG),
                                     (k_cal[one], v_cal[one], one), enc, q[one])
    require_standalone(enc, reference, decodings)
    batch = BitLedger.per_trial(_encode(fitted(torch.arange(3)), k, v))
    alone = BitLedger.per_trial(enc)
    require(float(batch.cache[1]) == float(alone.cache[0]) and float(batch.model[1]) == float(alone.model[0]),
             f"trial 1 is charged {float(batch.cache[1]):.0f} + {float(batch.model[1]):.0f} bits in a batch of 3 but "
             f"{float(alone.cache[0]):.0f} + {float(alone.model[0]):.0f} coded alone")


def check_model_constants_do_not_depend_on_the_cache(factory: Factory) -> None:
    """What a codec tags per model (Encoded.model) is the same whatever cache it codes."""
    k, v, _ = _data(0)
    k_other, v_other, _ = _data(1)
    scheme = _make(factory)
    fit_codec(scheme, k, v, torch.arange(SHAPE[0]))
    a, b = _encode(scheme, k, v), _encode(scheme, 3 * k_other, v_other)
    require(a.model == b.model, f"two caches tag different entries per model: {sorted(a.model ^ b.model)}")
    for key in a.model:
        part = "codes" if key in a.codes else "side"
        require(torch.equal(getattr(a, part)[key], getattr(b, part)[key]),
                 f"{part}.{key} is tagged per model but changes with the cache coded")


def check_score_matches_decode(factory: Factory) -> None:
    """score(q, enc) equals q·k̂ᵀ/√d with k̂ the decoded keys (in float64)."""
    k, v, q = _data(dtype=torch.float64)
    scheme = _make(factory)
    enc, (k_hat, _) = _roundtrip(scheme, k, v)
    logits = scheme.score(q, enc)
    b, h, s, d = SHAPE
    require(logits.shape == (b, h, N_QUERIES, s),
             f"score returns shape {tuple(logits.shape)}, not (B, H, Nq, S) = {(b, h, N_QUERIES, s)}")
    expected = q @ k_hat.transpose(-1, -2) / math.sqrt(d)
    require(torch.allclose(logits, expected, rtol=1e-9, atol=1e-9),
             f"score differs from q·decode(k)ᵀ/√d by up to {_largest(logits - expected):.3g}")


def check_kept_mask(factory: Factory) -> None:
    """kept(enc) is None (every token held) or a bool (B, H, S) mask keeping a token in every
    head; the tokens it evicts decode to zero."""
    k, v, _ = _data()
    scheme = _make(factory)
    enc, (k_hat, v_hat) = _roundtrip(scheme, k, v)
    kept = scheme.kept(enc) if hasattr(scheme, "kept") else None
    if kept is None:
        return
    require(kept.dtype == torch.bool and kept.shape == SHAPE[:3],
             f"kept() returns {kept.dtype} of shape {tuple(kept.shape)}, not bool of shape {SHAPE[:3]}")
    require(kept.device == k.device, f"kept() returns a mask on {kept.device} for a cache on {k.device}")
    require(kept.any(-1).all(), "kept() keeps no token in some head")
    for what, x_hat in (("K", k_hat), ("V", v_hat)):
        require(not x_hat[~kept].any(), f"an evicted token decodes to a non-zero {what}")


def check_error_not_growing_with_budget(factory: Factory) -> None:
    """The squared reconstruction error does not grow (beyond 2 %) from one accepted budget to
    the next, over 1..8 bits."""
    k, v, _ = _data(shape=(4, 1, 256, DIM))
    errors = {}
    for budget in range(MIN_BUDGET, MAX_BUDGET + 1):
        try:
            scheme = _make(factory, budget=budget)
        except ValueError:
            continue                                 # a budget this codec refuses
        _, (k_hat, v_hat) = _roundtrip(scheme, k, v)
        errors[budget] = float(((k - k_hat) ** 2).sum() + ((v - v_hat) ** 2).sum())
    budgets = sorted(errors)
    for lo, hi in zip(budgets, budgets[1:]):
        require(errors[hi] <= errors[lo] * 1.02,
                 f"the error grows from budget {lo} ({errors[lo]:.4g}) to budget {hi} ({errors[hi]:.4g})")


def check_edge_inputs_stay_finite(factory: Factory) -> None:
    """Zeros, constant rows, a single token, and magnitudes of 1e30 and 1e-30 decode to finite
    values (zeros to zeros) and score finitely."""
    b, h, s, d = SHAPE
    gen = torch.Generator().manual_seed(11)
    cases = {
        "zeros": torch.zeros(SHAPE),
        "constant rows": torch.full(SHAPE, 0.3),
        "one token": torch.randn(b, h, 1, d, generator=gen),
        "huge magnitudes": torch.randn(SHAPE, generator=gen) * 1e30,
        "tiny magnitudes": torch.randn(SHAPE, generator=gen) * 1e-30,
    }
    for case, x in cases.items():
        scheme = _make(factory)
        enc, (k_hat, v_hat) = _roundtrip(scheme, x, x.clone())
        q = torch.randn(x.shape[0], x.shape[1], N_QUERIES, d, generator=gen)
        require(torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all(),
                 f"a cache of {case} decodes to non-finite values")
        if case != "huge magnitudes":   # logits of 1e30-sized keys overflow float32 by construction
            require(torch.isfinite(scheme.score(q, enc)).all(), f"a cache of {case} scores non-finite logits")
        if case == "zeros":
            require(not k_hat.any() and not v_hat.any(), "a cache of zeros does not decode to zeros")


def check_trial_order_invariant(factory: Factory) -> None:
    """Permuting the trials (with their indices) permutes the output, and a trial coded alone
    decodes as in its batch: a codec never mixes trials."""
    k, v, _ = _data()
    perm = torch.tensor([2, 0, 1])
    _, (k_hat, v_hat) = _roundtrip(_make(factory), k, v, trials=torch.arange(3))
    _, (k_hat_p, v_hat_p) = _roundtrip(_make(factory), k[perm], v[perm], trials=perm)
    require(torch.allclose(k_hat_p, k_hat[perm], atol=1e-6) and torch.allclose(v_hat_p, v_hat[perm], atol=1e-6),
             "permuting the trials changes their decoded values, not only their order")
    _, (k_one, _) = _roundtrip(_make(factory), k[1:2], v[1:2], trials=torch.tensor([1]))
    require(torch.allclose(k_one, k_hat[1:2], atol=1e-6),
             f"a trial decodes differently alone than in its batch (by up to {_largest(k_one - k_hat[1:2]):.3g})")


def check_diagnostics_per_trial(factory: Factory) -> None:
    """diagnostics() after a fit gives one real value per trial under each name, and every name
    is an identifier that no metric already uses (the run store keeps each one)."""
    k, v, _ = _data()
    scheme = _make(factory)
    _roundtrip(scheme, k, v, trials=torch.arange(len(k)))
    for name, values in scheme.diagnostics().items():
        require(isinstance(name, str) and name.isidentifier() and name not in METRIC_NAMES,
                 f"diagnostic name {name!r} is not an identifier or is already a metric's")
        values = torch.as_tensor(values)
        require(values.shape == (len(k),), f"diagnostic {name} has shape {tuple(values.shape)} for {len(k)} "
                                            f"trials; one value per trial is ({len(k)},)")
        require(not values.is_complex() and values.dtype != torch.bool,
                 f"diagnostic {name} is {values.dtype}, not a real number per trial")


CHECKS: tuple[Check, ...] = tuple(
    Check.of(fn) for fn in (check_roundtrip_keeps_shape_dtype_device, check_same_seed_same_codes, check_input_not_mutated,
               check_ledger_matches_storage, check_encoding_stands_alone,
               check_model_constants_do_not_depend_on_the_cache,
               check_score_matches_decode, check_kept_mask, check_error_not_growing_with_budget,
               check_edge_inputs_stay_finite, check_trial_order_invariant, check_diagnostics_per_trial))


def check_scheme(factory: Factory, *, skip: tuple[str, ...] = ()) -> None:
    """Run every check (but those named in skip) on the factory's schemes; ConformanceError
    listing every failure, one sentence per check, if any fails. A check that raises something
    else reports it as the codec's error in that check."""
    run_checks(CHECKS, factory, skip, "the codec")


def pytest_params(factories: dict[str, Factory], expected_failures: dict[tuple[str, str], str] | None = None):
    """pytest parameters (check, factory) for every check and factory, ids `label-check`;
    expected_failures maps (check name, label) to the reason the pair is expected to fail
    (marked xfail, strict). Use: @pytest.mark.parametrize("check,factory", pytest_params({...}))
    and call check.run(factory)."""
    import pytest

    expected_failures = expected_failures or {}
    params = []
    for label, factory in factories.items():
        for check in CHECKS:
            reason = expected_failures.get((check.name, label))
            marks = [pytest.mark.xfail(reason=reason, strict=True, raises=ConformanceError)] if reason else []
            params.append(pytest.param(check, factory, id=f"{label}-{check.name}", marks=marks))
    return params
