"""Per-architecture tunables: one JSON file per architecture family, read by one function.

Every value a launcher, a gate or the dispatcher could tune -- the backend order per op, the QB
auto-mode threshold, the route capacity gate, tile shapes, decode thresholds, register caps --
lives in ``amdqb/configs/<arch>.json`` as an entry::

    "hip.route.lds_block": {"value": 1024,
                            "provenance": "measured: H200, 2026-11-30, python -m amdqb.bench.tune ...",
                            "why": "1024 x 2 routes: 4.23 us vs 5.01 for 256 x 5 (M=8192)"}

``provenance`` says where the value comes from: ``"measured: <device>, <date>, <bench command>"``,
``"seed: ..."`` for a figure taken from the source documents, ``"derived: ..."`` for a value
computed from something other than a timing (the AMD files: the code objects' occupancy), or
``"untuned: ..."``. A file holds
the entries that differ from ``default.json`` (which holds every key); :func:`load` merges the
two. ``amdqb info`` prints the merged entries of the device at hand.

Kernel constants reach the kernels only as ``-D`` defines derived from these entries (see
``amdqb.backends.hip._spec``), so the host's grid arithmetic and the kernels read one value.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DIR = Path(__file__).resolve().parent
DEFAULT = "default"
# ``backend_order.<op>`` entries may exist in an architecture's file alone; an op without one
# takes ``backend_order.default``.
BACKEND_ORDER = "backend_order."


@dataclass(frozen=True)
class Entry:
    value: Any
    provenance: str
    why: str = ""
    source: str = DEFAULT  # the file the entry came from


class ArchConfig:
    """The merged entries of one architecture family (``default.json`` + ``<arch>.json``)."""

    def __init__(self, arch: str, entries: dict[str, Entry]):
        self.arch = arch
        self._entries = entries

    def __getitem__(self, key: str):
        try:
            return self._entries[key].value
        except KeyError:
            raise KeyError(f"no config entry {key!r} (amdqb/configs/default.json)") from None

    def entry(self, key: str) -> Entry:
        return self._entries[key]

    def backend_order(self, op: str) -> tuple[str, ...]:
        """Backends to try for ``op``, in order."""
        entry = self._entries.get(BACKEND_ORDER + op) or self._entries[BACKEND_ORDER + "default"]
        return tuple(entry.value)

    def keys(self):
        return self._entries.keys()

    def items(self) -> Iterator[tuple[str, Entry]]:
        return iter(sorted(self._entries.items()))

    def with_values(self, values: dict[str, Any], provenance: str) -> ArchConfig:
        """A copy with ``values`` replacing existing entries (tuning sweeps build variants so)."""
        merged = dict(self._entries)
        for key, value in values.items():
            if key not in merged:
                raise KeyError(f"no config entry {key!r} to override")
            merged[key] = Entry(value, provenance, "", "override")
        return ArchConfig(self.arch, merged)


def config_path(arch: str) -> Path:
    return _DIR / f"{arch}.json"


def _read(path: Path) -> dict[str, Entry]:
    raw = json.loads(path.read_text())
    entries = {}
    for key, item in raw["entries"].items():
        if not isinstance(item, dict) or "value" not in item or "provenance" not in item:
            raise ValueError(f"{path.name}: entry {key!r} needs 'value' and 'provenance'")
        entries[key] = Entry(item["value"], item["provenance"], item.get("why", ""), path.stem)
    return entries


def available() -> list[str]:
    """Architecture families that have a config file (``default`` first)."""
    names = sorted(p.stem for p in _DIR.glob("*.json") if p.stem != DEFAULT)
    return [DEFAULT, *names]


_OVERRIDES: dict[str, ArchConfig] = {}


@functools.cache
def _load_files(arch: str) -> ArchConfig:
    entries = _read(config_path(DEFAULT))
    path = config_path(arch)
    if arch != DEFAULT and path.is_file():
        for key, entry in _read(path).items():
            if key not in entries and not key.startswith(BACKEND_ORDER):
                raise ValueError(f"{path.name}: {key!r} is not a key of default.json")
            entries[key] = entry
    return ArchConfig(arch if path.is_file() else DEFAULT, entries)


def load(arch: str) -> ArchConfig:
    """The config of architecture family ``arch`` (``default`` where no file exists)."""
    override = _OVERRIDES.get(arch)
    return override if override is not None else _load_files(arch)


@contextlib.contextmanager
def override(arch: str, values: dict[str, Any], provenance: str = "override"):
    """Within the block, :func:`load` of ``arch`` returns its config with ``values`` replaced.

    Launchers read their config on every call, so a CUDA graph captured inside the block holds
    the variant's kernels and launch shapes (how ``amdqb/bench/tune.py`` compares variants)."""
    previous = _OVERRIDES.get(arch)
    _OVERRIDES[arch] = load(arch).with_values(values, provenance)
    try:
        yield _OVERRIDES[arch]
    finally:
        if previous is None:
            _OVERRIDES.pop(arch, None)
        else:
            _OVERRIDES[arch] = previous


def write(arch: str, values: dict[str, tuple[Any, str, str]], remove: tuple[str, ...] = ()) -> Path:
    """Write ``{key: (value, provenance, why)}`` into ``<arch>.json`` and drop the entries named
    in ``remove`` (the default's value then stands); other entries kept."""
    path = config_path(arch)
    raw = json.loads(path.read_text()) if path.is_file() else {"arch": arch, "entries": {}}
    known = _read(config_path(DEFAULT))
    for key, (value, provenance, why) in values.items():
        if key not in known and not key.startswith(BACKEND_ORDER):
            raise KeyError(f"no config entry {key!r} in default.json")
        raw["entries"][key] = {"value": value, "provenance": provenance, "why": why}
    for key in remove:
        raw["entries"].pop(key, None)
    path.write_text(dumps(raw["arch"], raw["entries"]))
    _load_files.cache_clear()
    return path


def dumps(arch: str, entries: dict) -> str:
    """The file text of a config: one entry per block, values on one line."""
    lines = ["{", f'  "arch": {json.dumps(arch)},', '  "entries": {']
    items = sorted(entries.items())
    for i, (key, item) in enumerate(items):
        names = ("value", "provenance", "why") if item.get("why") else ("value", "provenance")
        fields = [f'"{name}": {json.dumps(item[name])}' for name in names]
        body = ",\n      ".join(fields)
        lines.append(
            f"    {json.dumps(key)}: {{\n      {body}\n    }}" + ("," if i + 1 < len(items) else "")
        )
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"
