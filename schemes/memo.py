"""A memo of the last few results of a pure function of tensors, keyed by the tensor objects
themselves (used by SpectralQuant to share a chunk's calibration, bases and sketches between the
cells that code the same data)."""
from __future__ import annotations

import weakref

import torch


class IdentityMemo:
    """The last few results of a pure function of tensors, keyed by the tensors themselves.

    A hit needs the very same tensor objects, alive (weak references) and unmodified (their
    version counters), and the same tag, so a freed tensor whose memory is reused can never be
    mistaken for one seen before; an entry is dropped as soon as one of its tensors is freed,
    so the memo never keeps a result alive longer than its inputs. Inference-mode tensors have
    no version counter and are never remembered. Used for what every sq/squ cell sharing a
    chunk of trials would otherwise recompute: the calibration of k_cal / v_cal (eigen-analysis,
    basis, σ: functions of the data and the RNG family of the start block), the decoder's
    orthonormalised basis (a function of the stored codes), and the sketch matrices of a cache
    (functions of its stored seeds), which its encode, decode and score would each redraw."""

    def __init__(self, size: int):
        self.size = size
        self.entries: dict[int, tuple[tuple, tuple, object, object]] = {}
        self._next = 0

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
