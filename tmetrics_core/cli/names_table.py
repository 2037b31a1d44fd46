"""Printing the tensor manifest (`tmetrics names`): an aligned text table or JSON.

A manifest row is a mapping with the keys of `MANIFEST_KEYS` (``origins`` and ``verified`` may
be absent, as in manifests written before they existed):

==============  ===========================================================================
``name``        canonical name (str)
``original``    name from ``named_parameters()`` (str)
``layer``       global layer index (int or None)
``expert``      global expert index (int or None)
``component``   canonical component, e.g. ``"attn.q"`` (str)
``shape``       logical (global) shape (sequence of int)
``dtype``       dtype (``torch.dtype`` or str; ``"torch."`` is dropped)
``numel``       elements of the logical tensor (int)
``placements``  axis name -> short placement tag, e.g. ``{"fsdp": "S(0)", "dp": "R"}``
``owners``      ``"all"``, or axis name -> the coordinates holding it on the axes where
                not every coordinate does (``{"pp": [1]}``), or (older manifests) the
                global ranks holding a piece (sequence of int)
``origins``     axis name -> where its placement came from: ``declared`` (config
                ``placements:``), ``framework`` (an integration), ``dtensor``, ``inferred``
                (who holds the name); an axis here but not in ``placements`` is a Replica claim
``verified``    axis name -> source kinds (``param``, ``grad``...) whose Replica claim was
                checked against the values on every rank of the axis
==============  ===========================================================================

The table's ``origin`` column shows each claimed axis as ``axis=tag:origin``, with ``+kinds``
when verified, e.g. ``dp=R:inferred+param,grad tp=S0:dtensor``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from tmetrics_core.errors import ConfigError

__all__ = [
    "MANIFEST_KEYS",
    "format_declared",
    "format_manifest",
]

MANIFEST_KEYS: tuple[str, ...] = (
    "name",
    "original",
    "layer",
    "expert",
    "component",
    "shape",
    "dtype",
    "numel",
    "placements",
    "owners",
    "origins",
    "verified",
)

_OPTIONAL: dict[str, dict[str, Any]] = {"origins": {}, "verified": {}}
_HEADERS = ("canonical", "original", "layer", "expert", "component", "shape", "dtype", "numel", "placements", "owners",
            "origin")
_COLUMNS = MANIFEST_KEYS[:-1]
_RIGHT_ALIGNED = frozenset({"layer", "expert", "numel"})


def format_manifest(entries: Sequence[Mapping[str, Any]], *, fmt: Literal["table", "json"] = "table") -> str:
    """The manifest as text, rows in the given order.

    ``fmt="table"``: one header line and one line per row, columns separated by two spaces,
    numbers right-aligned, None shown as ``-``, shapes as ``64x32`` (``()`` for a scalar),
    placements as ``axis=tag`` pairs, owner ranks with consecutive runs folded (``0-3,8``).
    ``fmt="json"``: a JSON array of objects with the keys of `MANIFEST_KEYS` in that order;
    shapes and owner lists as arrays, dtypes as strings.

    Raises:
        ConfigError: an unknown ``fmt``, or a row whose keys are not exactly `MANIFEST_KEYS`
            (``path`` names the row, the message lists missing and unexpected keys).
    """
    if fmt not in ("table", "json"):
        raise ConfigError(f"unknown format {fmt!r}; valid: 'table', 'json'", path="fmt")
    rows = [_normalized(index, entry) for index, entry in enumerate(entries)]
    if fmt == "json":
        return json.dumps(rows, indent=2)
    cells = [_HEADERS] + [tuple(_origin(row) if key == "origins" else _cell(key, row[key]) for key in _COLUMNS)
                          for row in rows]
    widths = [max(len(line[column]) for line in cells) for column in range(len(_COLUMNS))]
    lines = []
    for line in cells:
        padded = (
            text.rjust(width) if key in _RIGHT_ALIGNED else text.ljust(width)
            for key, text, width in zip(_COLUMNS, line, widths)
        )
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def format_declared(placements: Mapping[str, Mapping[str, str]], verify_replicas: str) -> str:
    """The config's ``placements:`` as ``tmetrics validate`` prints them: one line per glob and
    axis (``origin declared``), each saying whether a run verifies it: Replica claims are
    compared across their axis unless ``verify_replicas`` is ``never``; Shard, Owned and
    Partial declarations are taken as given (their pieces differ by design)."""
    if not placements:
        return (f"placements: none declared; every placement comes from a framework, DTensor or inference "
                f"(Replica claims verified: {verify_replicas})")
    rows = [("glob", "axis", "placement", "origin", "verified in a run")]
    for pattern, spec in placements.items():
        for axis, tag in spec.items():
            replica = str(tag).strip() in ("R", "Replica()", "Replicate()")
            rows.append((pattern, axis, str(tag), "declared",
                         (f"yes (verify_replicas: {verify_replicas})" if verify_replicas != "never"
                          else "no (verify_replicas: never)") if replica
                         else "no (taken as declared)"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _normalized(index: int, entry: Mapping[str, Any]) -> dict[str, Any]:
    missing = [key for key in MANIFEST_KEYS if key not in entry and key not in _OPTIONAL]
    unexpected = sorted(str(key) for key in entry if key not in MANIFEST_KEYS)
    if missing or unexpected:
        raise ConfigError(
            f"manifest row needs exactly the keys {list(MANIFEST_KEYS)}; missing {missing}, unexpected {unexpected}",
            path=f"entries[{index}]",
        )
    row = {key: entry.get(key, _OPTIONAL.get(key)) for key in MANIFEST_KEYS}
    row["origins"] = {str(axis): str(origin) for axis, origin in row["origins"].items()}
    row["verified"] = {str(axis): [str(kind) for kind in kinds] for axis, kinds in row["verified"].items()}
    row["shape"] = [int(size) for size in entry["shape"]]
    row["dtype"] = str(entry["dtype"]).removeprefix("torch.")
    row["placements"] = {str(axis): str(tag) for axis, tag in entry["placements"].items()}
    owners = entry["owners"]
    if isinstance(owners, Mapping):
        row["owners"] = {str(axis): [int(c) for c in coords] for axis, coords in owners.items()}
    else:
        row["owners"] = owners if owners == "all" else [int(rank) for rank in owners]
    return row


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "shape":
        return "x".join(str(size) for size in value) if value else "()"
    if key == "placements":
        return " ".join(f"{axis}={tag}" for axis, tag in value.items()) or "-"
    if key == "owners":
        if isinstance(value, Mapping):
            return " ".join(f"{axis}={_ranks(coords)}" for axis, coords in value.items())
        return value if value == "all" else _ranks(value)
    return str(value)


def _origin(row: Mapping[str, Any]) -> str:
    """``dp=R:inferred+param,grad tp=S0:dtensor``; ``-`` when no axis was claimed."""
    cells = []
    for axis, origin in row["origins"].items():
        kinds = row["verified"].get(axis)
        cells.append(f"{axis}={row['placements'].get(axis, 'R')}:{origin}" + (f"+{','.join(kinds)}" if kinds else ""))
    return " ".join(cells) or "-"


def _ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``; an empty list -> ``"-"``."""
    runs: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"
