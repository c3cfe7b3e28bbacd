"""One fixed look per codec, in every figure of every report, and the codec families that
figures are faceted by (no panel draws more than MAX_SERIES codecs).

A codec's family fixes its marker and line style; its place in the family fixes its colour
(seaborn's colour-blind palette), so two codecs differ in colour within a family and in marker
across families, and stay tellable in grey. The registered codecs (and kvpress's bridged presses) have their places written out below, so a
codec looks the same whichever others a run has; a plug-in codec gets a place from a hash of its
name (stable across runs).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

from matplotlib.colors import to_rgb

MAX_SERIES = 8  # codecs per panel

# (family, marker, line style, the registered members in the order that fixes their colours)
_FAMILIES = (
    ("TurboQuant", "o", "-", ("plain-kv", "tq-kv", "tq-qkv", "tq-kqv", "tq-qkqv", "tq-fkv", "tq-kfv", "tq-fkfv")),
    ("SpectralQuant", "s", "--", ("sq-kv", "sq-qkv", "sq-kqv", "sq-qkqv")),
    ("SpectralQuant uniform", "D", "-.", ("squ-kv", "squ-qkv", "squ-kqv", "squ-qkqv")),
    ("Shard", "^", (0, (5, 1)), ("shard", "shard-pca-decode")),
    ("quantisation and low-rank baselines", "v", ":", ("int8", "int4", "kivi", "svd")),
    ("eviction", "P", (0, (3, 1, 1, 1)), ("h2o", "streaming", *(f"kvpress:{press}" for press in (
        "StreamingLLMPress", "SnapKVPress", "TOVAPress", "KnormPress", "ObservedAttentionPress",
        "ExpectedAttentionPress", "KeyDiffPress", "PyramidKVPress", "CURPress", "LagKVPress", "RandomPress",
        "CompactorPress", "LeverageScorePress", "NonCausalAttnPress", "CapPress")))),
    ("other", "X", (0, (1, 1)), ()),
)
# seaborn's colour-blind palette first; its "dark" variant gives a family of more than 10 (eviction
# with kvpress's presses) distinct colours for its members 11-20. Written out (seaborn 0.13's
# SEABORN_PALETTES, as sns.color_palette returns them): importing seaborn for these was a tenth of
# a second of every report (issue 49)
_PALETTE = [to_rgb(c) for c in (
    "#0173B2", "#DE8F05", "#029E73", "#D55E00", "#CC78BC", "#CA9161", "#FBAFE4", "#949494", "#ECE133", "#56B4E9",
    "#001C7F", "#B1400D", "#12711C", "#8C0800", "#591E71", "#592F0D", "#A23582", "#3C3C3C", "#B8850A", "#006374")]


@dataclass(frozen=True)
class SchemeStyle:
    colour: tuple
    marker: str
    line: object


def family(name: str) -> str:
    """The family a codec is drawn with: by its registered place, else by its name's prefix
    (tq-, sq-, squ-, shard, kvpress: presses are eviction), else 'other'."""
    for fam, _, _, members in _FAMILIES:
        if name in members:
            return fam
    if name.startswith("squ-"):
        return "SpectralQuant uniform"
    if name.startswith("sq-"):
        return "SpectralQuant"
    if name.startswith("tq-"):
        return "TurboQuant"
    if name.startswith("shard"):
        return "Shard"
    if name.startswith("kvpress:"):
        return "eviction"
    return "other"


def style(name: str) -> SchemeStyle:
    fam = family(name)
    _, marker, line, members = next(f for f in _FAMILIES if f[0] == fam)
    place = members.index(name) if name in members else zlib.crc32(name.encode()) % 10  # first 10: colour-blind
    return SchemeStyle(_PALETTE[place % len(_PALETTE)], marker, line)


def scheme_styles(names) -> dict[str, SchemeStyle]:
    """The fixed style of each name."""
    return {name: style(name) for name in sorted(set(names))}


def panel_groups(names) -> list[tuple[str, list[str]]]:
    """The codecs split into panels of at most MAX_SERIES: one per family in the table's order
    (a larger family split into numbered parts), members in their registered order."""
    out = []
    for fam, _, _, members in _FAMILIES:
        mine = sorted((n for n in set(names) if family(n) == fam),
                      key=lambda n: (members.index(n) if n in members else len(members), n))
        parts = [mine[i:i + MAX_SERIES] for i in range(0, len(mine), MAX_SERIES)]
        for i, part in enumerate(parts):
            out.append((fam if len(parts) == 1 else f"{fam} ({i + 1})", part))
    return out
