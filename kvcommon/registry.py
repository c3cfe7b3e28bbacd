"""The one registry type: names → entries in registration order, for the codecs
(schemes.registry), their NumPy references (schemes.reference) and the scenarios."""
from __future__ import annotations

from typing import Generic, Iterable, TypeVar

T = TypeVar("T")
# the codecs' implementations: torch, and the independent NumPy reference (--impl); here, not in
# schemes.registry, so a configuration is checked against them without importing the codecs
IMPLS = ("torch", "reference")


class Registry(Generic[T]):
    """Names → entries in registration order: the one registry type of the codecs, their NumPy
    references and the scenarios. A name is non-empty, lowercase, not 'all' and unique; a miss
    says what is available."""

    def __init__(self, kind: str, where: str = ""):
        self.kind, self.where = kind, where        # "scheme", " for the reference implementation"
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if not name or name != name.lower() or name == "all" or name in self._entries:
            raise ValueError(f"{self.kind} name {name!r} is empty, not lowercase, reserved or taken")
        self._entries[name] = entry

    def remove(self, name: str) -> None:
        """Take `name` out (KeyError when it is not registered)."""
        del self._entries[name]

    def get(self, name: str) -> T | None:
        return self._entries.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def as_dict(self) -> dict[str, T]:
        return dict(self._entries)

    def unknown(self, name: str, available: Iterable[str] | None = None) -> str:
        """The one-line message of a miss; `available` where the valid names are not just these."""
        return (f"unknown {self.kind} {name!r}{self.where}; available: "
                f"{', '.join(self.names() if available is None else available)}")

    def lookup(self, name: str, available: Iterable[str] | None = None) -> T:
        entry = self.get(name)
        if entry is None:
            raise ValueError(self.unknown(name, available))
        return entry
