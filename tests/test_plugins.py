"""Third-party codecs arrive through the entry-point group kvharness.schemes and pass the
conformance suite with no test code of their own."""
from dataclasses import dataclass

import pytest
import torch

import schemes
from conformance import CHECKS
from schemes import Encoded, Scheme, registry
from schemes.packing import pack_bits, unpack_bits


@dataclass
class RoundKV(Scheme):
    """Toy plug-in: per-token max-abs scale (float32) and uniform mid-rise codes of `budget` bits."""
    name = "round-kv"

    def _encode(self, x, prefix, enc):
        scale = x.abs().amax(-1, keepdim=True)   # 0 for an all-zero token: decodes to zeros
        levels = 2 ** self.budget
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        idx = torch.clamp(((x / safe + 1) / 2 * levels).floor(), 0, levels - 1).to(torch.int64)
        enc.codes[f"{prefix}.codes"] = pack_bits(idx, self.budget)
        enc.codes[f"{prefix}.scale"] = scale.squeeze(-1).to(torch.float32)

    def _decode(self, enc, prefix):
        idx = unpack_bits(enc.codes[f"{prefix}.codes"], self.budget, self.dim).to(enc.dtype)
        return ((idx + 0.5) / 2 ** self.budget * 2 - 1) * enc.codes[f"{prefix}.scale"].to(enc.dtype).unsqueeze(-1)

    def encode(self, k, v):
        enc = Encoded(tuple(k.shape), k.dtype)
        self._encode(k, "k", enc)
        self._encode(v, "v", enc)
        return enc

    def decode(self, enc):
        return self._decode(enc, "k"), self._decode(enc, "v")


class FakeEntryPoint:
    name = "round-kv"
    group = registry.ENTRY_POINT_GROUP

    def load(self):
        return RoundKV


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.setattr(registry.metadata, "entry_points",
                        lambda group: [FakeEntryPoint()] if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_plugins", None)
    yield "round-kv"
    registry._plugins = None


def test_plugin_is_listed_and_created(plugin):
    assert plugin in schemes.available()
    assert schemes.specs()[plugin].description.startswith("Toy plug-in")
    s = schemes.create(plugin, budget=4, dim=16)
    assert isinstance(s, RoundKV) and s.budget == 4


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_plugin_passes_conformance(plugin, check):
    check(plugin)


def test_plugin_never_shadows_a_builtin(monkeypatch):
    class Shadow(FakeEntryPoint):
        name = "tq-kv"
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [Shadow()])
    monkeypatch.setattr(registry, "_plugins", None)
    assert schemes.specs()["tq-kv"].factory is not RoundKV
    registry._plugins = None
