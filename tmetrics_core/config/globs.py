"""Alternatives in name globs: ``layers.*.{mlp,moe}`` is ``layers.*.mlp`` or ``layers.*.moe``.

``fnmatch`` has ``*``, ``?`` and ``[...]`` but no alternatives, and one config should serve a
dense and an MoE model, whose blocks name their feed-forward part differently. Braces are
expanded when the config is read, shell-style (``{a,b}x{c,d}`` gives four globs, braces may
nest), so every matcher downstream sees plain ``fnmatch`` globs.
"""

from __future__ import annotations

__all__ = ["expand_braces"]


def expand_braces(glob: str) -> tuple[str, ...]:
    """Every glob that ``glob``'s brace alternatives spell, in order; ``glob`` alone if it has
    no braces.

    Raises:
        ValueError: an unbalanced ``{`` or ``}``, or braces with no comma (``{mlp}``: write
            ``mlp``).
    """
    open_at = glob.find("{")
    if open_at < 0:
        if "}" in glob:
            raise ValueError(f"{glob!r} has a '}}' with no '{{' before it")
        return (glob,)
    if "}" in glob[:open_at]:
        raise ValueError(f"{glob!r} has a '}}' with no '{{' before it")
    depth, parts, start = 0, [], open_at + 1
    for at in range(open_at, len(glob)):
        char = glob[at]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                parts.append(glob[start:at])
                break
        elif char == "," and depth == 1:
            parts.append(glob[start:at])
            start = at + 1
    else:
        raise ValueError(f"{glob!r} has a '{{' that is never closed")
    if len(parts) < 2:
        raise ValueError(f"{glob!r}: braces need two or more alternatives separated by ',' (e.g. {{mlp,moe}})")
    head, tail = glob[:open_at], glob[at + 1:]
    return tuple(out for part in parts for out in expand_braces(head + part + tail))
