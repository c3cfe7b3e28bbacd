"""A memo of the last few results of a pure function of tensors, keyed by the tensor objects
themselves: how the cells that code the same chunk of data share what depends on the data alone
(unit rows and norms, SpectralQuant's calibration, bases, sketches and codes, Shard's V codes)."""
from __future__ import annotations

import weakref

import torch


class IdentityMemo:
    """The last few results of a pure function of tensors, keyed by the tensors themselves.

    A hit needs the very same tensor objects, alive (weak references) and unmodified (their
    version counters), and the same tag, so a freed tensor whose memory is reused can never be
    mistaken for one seen before; an entry is dropped as soon as one of its tensors is freed,
    so the memo never keeps a result alive longer than its inputs. Inference-mode tensors have
    no version counter and are never remembered. Used for what every cell sharing a chunk of
    trials would otherwise recompute: the unit rows and norms of K and V (schemes/unit_rows.py),
    SpectralQuant's calibration of k_cal / v_cal (eigen-analysis, basis, σ: functions of the
    data and the RNG family of the start block), its decoder's orthonormalised basis and codes
    (functions of the stored codes) and a cache's sketch matrices (functions of its stored
    seeds), and Shard's V codes. A remembered result is shared: its users never write it in place."""

    _every: "weakref.WeakSet[IdentityMemo]" = weakref.WeakSet()

    def __init__(self, size: int):
        IdentityMemo._every.add(self)
        self.size = size
        self.entries: dict[int, tuple[tuple, tuple, object, object]] = {}
        self._next = 0

    @classmethod
    def forget_all(cls) -> None:
        """Empty every memo (compiled.batched, when a held call failed)."""
        for memo in list(cls._every):
            memo.entries.clear()

    @staticmethod
    def _trackable(tensors) -> bool:
        return not any(t.is_inference() for t in tensors)

    def get(self, tensors: tuple[torch.Tensor, ...], tag: object = None):
        if not self._trackable(tensors):
            return None
        for refs, versions, stored_tag, value in self.entries.values():
            if stored_tag == tag and all(r() is t for r, t in zip(refs, tensors)) and \
                    versions == tuple(t._version for t in tensors):
                return value
        return None

    def put(self, tensors: tuple[torch.Tensor, ...], value, tag: object = None):
        if not self._trackable(tensors):
            return value
        key, self._next = self._next, self._next + 1
        while len(self.entries) >= self.size:
            del self.entries[min(self.entries)]                        # the oldest
        refs = tuple(weakref.ref(t, lambda _, k=key: self.entries.pop(k, None)) for t in tensors)
        self.entries[key] = (refs, tuple(t._version for t in tensors), tag, value)
        return value

    def get_or_compute(self, tensors: tuple[torch.Tensor, ...], compute, tag: object = None):
        """compute()'s result for the very tensors under tag: the remembered one, or computed now
        and remembered."""
        known = self.get(tensors, tag)
        return known if known is not None else self.put(tensors, compute(), tag)
