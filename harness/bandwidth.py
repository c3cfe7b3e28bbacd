"""Memory bandwidth measured in the bench's own run, and the bytes a codec's encode+decode must
move at least: the two together say how near a codec runs to the memory limit.

- triad: STREAM's triad a = b + s·c (one fused torch.add on float64 arrays, on the device and
  with the torch threads the bench runs the codecs with), best of several repetitions. Bytes
  counted as STREAM counts them: 3 × 8 per element (read b and c, write a); the extra read a
  cache's write-allocate makes of a is not counted, so the figure is STREAM's, not the bus's.
  Each array is at least 4× the last-level cache by default (STREAM's rule), so the triad
  streams from memory, not from cache.
- codec traffic: per vector (one token of K or V, d elements), the least an encode followed by
  a decode must move: read the vector in its dtype, write its codes as stored; read the codes,
  write the decoded vector in the dtype decode returns. The codes' bytes are the sweep's
  per-cache ledger of the stored tensors (schemes.base.BitLedger.per_trial, never the codec's
  own bits()), per vector; per-model constants (codebooks, rotation signs, sketch
  matrices; Encoded.model) are left out: a deployment holds them once per layer-head, not per
  vector. A codec that moves more (a dozen passes over the vector) reaches a smaller fraction.
- fraction of the bandwidth: vectors/s × minimum bytes per vector ÷ the triad's bytes/s. It is
  the share of the memory's streaming rate the codec's useful traffic reaches; it is not
  bounded by 1 (a cache that fits in the last-level cache can be served faster than memory),
  though a codec near 1 on caches beyond the cache is at the memory limit.
"""
from __future__ import annotations

import glob

import torch

from . import timing

TRIAD_BYTES_PER_ELEMENT = 3 * 8     # float64: read b, read c, write a (STREAM's count)
TRIAD_SCALAR = 3.0
MIN_ARRAY_BYTES = 64 << 20          # when the last-level cache is unknown or small


def last_level_cache_bytes(device: torch.device) -> int | None:
    """Bytes of the last-level cache: a CUDA device's L2; on a CPU, every distinct last-level
    cache the kernel lists (/sys/devices/system/cpu/cpu*/cache/index*: highest level, summed over
    the sets of CPUs sharing one); None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size) or None
    caches: dict[tuple[int, str], int] = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(f"{index}/level") as f:
                level = int(f.read())
            with open(f"{index}/type") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(f"{index}/shared_cpu_list") as f:
                shared = f.read().strip()
            with open(f"{index}/size") as f:
                size = _cache_size(f.read().strip())
        except (OSError, ValueError):
            continue
        caches[(level, shared)] = size
    if not caches:
        return None
    top = max(level for level, _ in caches)
    return sum(size for (level, _), size in caches.items() if level == top)


def _cache_size(text: str) -> int:
    """'491520K' / '32M' / '2048' (sysfs) → bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def triad_array_bytes(llc_bytes: int | None, available_bytes: int) -> int:
    """Default size of each triad array: 4× the last-level cache (STREAM's rule), at least
    MIN_ARRAY_BYTES, at most an eighth of the available memory (three arrays: 3/8 of it)."""
    want = max(4 * (llc_bytes or 0), MIN_ARRAY_BYTES)
    return max(min(want, available_bytes // 8), 1 << 20)


def triad(array_bytes: int, device: torch.device, repeats: int = 5) -> dict:
    """STREAM triad a = b + s·c on three float64 arrays of array_bytes each (rounded down to whole
    elements), timed `repeats` times after a warm-up pass; the figure is from the fastest pass.
    Checks the result (b = 1, c = 2, s = 3: every a is 7 exactly)."""
    n = max(array_bytes // 8, 1)
    b = torch.ones(n, dtype=torch.float64, device=device)
    c = torch.full((n,), 2.0, dtype=torch.float64, device=device)
    a = torch.zeros(n, dtype=torch.float64, device=device)   # every array touched before timing
    passes = timing.samples(lambda: torch.add(b, c, alpha=TRIAD_SCALAR, out=a), repeats, device)
    if not bool((a == 1.0 + TRIAD_SCALAR * 2.0).all()):
        raise RuntimeError("the bandwidth triad computed a wrong result")
    moved = TRIAD_BYTES_PER_ELEMENT * n
    return {"kernel": "a = b + 3·c, float64 (torch.add, one pass)", "elements": n, "array_bytes": 8 * n,
            "bytes_per_element": TRIAD_BYTES_PER_ELEMENT, "bytes_per_pass": moved, "repeats": repeats,
            "samples_s": passes, "gb_per_s": moved / min(passes) / 1e9}


def memory_bandwidth(device: torch.device, array_bytes: int | None = None, repeats: int = 5) -> dict:
    """The triad on `device` with the current torch threads, its arrays array_bytes each (None:
    triad_array_bytes), with the last-level cache and the device's peak where known."""
    from .devices import available_memory_bytes
    llc = last_level_cache_bytes(device)
    if array_bytes is None:
        array_bytes = triad_array_bytes(llc, available_memory_bytes(device))
    result = triad(array_bytes, device, repeats)
    result.update(threads=torch.get_num_threads(), device=str(device), llc_bytes=llc,
                  array_over_llc=result["array_bytes"] / llc if llc else None)
    peak = device_peak(device)
    if peak is not None:
        result.update(peak_gb_per_s=peak[0], peak_source=peak[1], fraction_of_peak=result["gb_per_s"] / peak[0])
    return result


def device_peak(device: torch.device) -> tuple[float, str] | None:
    """(GB/s, where from) of a CUDA device's theoretical memory bandwidth, 2 × memory clock ×
    bus width (the double data rate formula of CUDA's bandwidth samples), from torch's device
    properties or NVML; None on a CPU or when neither says."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, width = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock_khz and width:
        return 2 * clock_khz * 1e3 * width / 8 / 1e9, "torch device properties (memory clock × bus width)"
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        width = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return 2 * clock_mhz * 1e6 * width / 8 / 1e9, "NVML (max memory clock × bus width)"
    except Exception:   # no pynvml, or a driver without these queries: the peak is unknown
        return None


def codec_traffic(k: torch.Tensor, enc, decoded: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The least an encode+decode of K and V (B, H, S, d) must move, per vector (one token of K
    or V): bytes read in, the codes' bytes (the sweep's measured ledger of the stored tensors,
    BitLedger.per_trial: a trial's per-cache bits over its 2·H·S vectors, averaged over the
    trials; written once and read once), bytes written out."""
    from schemes.base import BitLedger
    _, h, s, d = enc.shape
    code = float(BitLedger.per_trial(enc).cache.mean()) / 8 / (2 * h * s)
    read_in, write_out = d * k.element_size(), d * decoded[0].element_size()
    return {"read_bytes_per_vector": read_in, "code_bytes_per_vector": code, "write_bytes_per_vector": write_out,
            "bytes_per_vector": read_in + 2 * code + write_out}


def fraction_of_bandwidth(vectors_per_s: float, bytes_per_vector: float, gb_per_s: float) -> float:
    return vectors_per_s * bytes_per_vector / (gb_per_s * 1e9)


def bandwidth_lines(result: dict) -> list[str]:
    """The bench result's bandwidth figures as text (harness bench, scripts/gpu_check.sh): the
    triad, the device's peak where known, and per codec, implementation and budget the least
    bytes per vector with the fraction of the triad reached (and of the peak, where known)."""
    bw = result["bandwidth"]
    llc = (f" = {bw['array_over_llc']:.1f}x the {bw['llc_bytes'] / 2 ** 20:.0f} MiB last-level cache"
           if bw["llc_bytes"] else ", last-level cache unknown")
    lines = [f"memory bandwidth {bw['gb_per_s']:.1f} GB/s on {bw['device']}: STREAM triad a = b + s·c, float64, "
             f"{bw['bytes_per_element']} bytes per element (read b, c; write a), arrays of "
             f"{bw['array_bytes'] / 2 ** 20:.0f} MiB{llc}, {bw['threads']} threads, best of {bw['repeats']}"]
    peak = bw.get("peak_gb_per_s")
    if peak:
        lines.append(f"device peak {peak:.0f} GB/s ({bw['peak_source']}): the triad reaches "
                     f"{bw['fraction_of_peak']:.0%} of it")
    lines.append("least bytes an encode+decode moves per vector (read K/V, write the codes as the codec's ledger "
                 "counts them; read the codes, write K̂/V̂) and the fraction of the triad's bandwidth reached"
                 + (" (of the device's peak)" if peak else "") + ":")
    for name, by_impl in result["schemes_bytes_per_vector"].items():
        for impl, by_budget in by_impl.items():
            cells = []
            for b, n in by_budget.items():
                f = result["schemes_fraction_of_bandwidth"][name][impl][b]
                cells.append(f"b={b}: {n:,.1f} B {f:.1%}" + (f" ({f * bw['gb_per_s'] / peak:.1%})" if peak else ""))
            lines.append(f"  {name:<18} {impl:<9} " + "  ".join(cells))
    return lines
