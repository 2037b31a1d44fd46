"""The nearest canonical name to a glob that matched nothing, for configuration errors.

``select:`` globs match canonical tensor names and ``modules:`` globs canonical module names
(or the model's module paths); a glob written in another naming, or with a typo, gets the
closest name of the right naming in its error. Names are compared with their layer and expert
indices written ``*`` (``layers.*.moe.experts.*.up.weight``), as globs usually are.
"""

from __future__ import annotations

import difflib
import re
from typing import Iterable, Sequence

__all__ = ["nearest"]

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")


def nearest(patterns: Sequence[str], names: Iterable[str], *, prefixes: bool = False) -> str | None:
    """The name (indices as ``*``) of ``names`` most like one of ``patterns`` by
    ``difflib.SequenceMatcher`` ratio, or None without names. With ``prefixes``, the globs of
    every module level are candidates too (``layers.*.mlp.*`` for ``layers.*.mlp.up.weight``)."""
    found = {_INDEX.sub("*", name) for name in names}
    if prefixes:
        found |= {".".join(f.split(".")[:n]) + ".*" for f in found for n in range(1, f.count(".") + 1)}
    families = sorted(found)
    best, score = None, -1.0
    for pattern in patterns:
        for family in families:
            ratio = difflib.SequenceMatcher(None, pattern, family).ratio()
            if ratio > score:
                best, score = family, ratio
    return best
