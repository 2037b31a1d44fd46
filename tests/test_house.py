"""The house rules of `tmetrics_core`, checked on its source (issue 33's "done when"):

- file size: no file over 450 lines, at most 5 over 400;
- imports: no circle between modules (imports inside functions and under ``TYPE_CHECKING`` count:
  a type-only import is a dependency too, and ``farm-studio look`` draws it);
- collectives and process-group queries: ``torch.distributed`` is called only under
  ``distributed/`` (and by the demo, which is a user's training program);
- private torch names only in ``torch_private.py``;
- which rank speaks is decided only by the reporter (no ``global_rank == 0`` elsewhere; the demo,
  a user's training program, picks its progress-bar rank as users do).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tmetrics_core"
FILES = sorted(p for p in ROOT.rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module(path: Path) -> str:
    parts = ["tmetrics_core", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_file_over_450_lines_and_at_most_5_over_400() -> None:
    lines = {_relative(p): len(p.read_text().splitlines()) for p in FILES}
    assert [f"{n} {c}" for n, c in lines.items() if c > 450] == []
    over = sorted(f"{n} {c}" for n, c in lines.items() if c > 400)
    assert len(over) <= 5, over


def _imports(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != here and not here.startswith(name + "."):
                found.add(name)
    return found


def test_no_import_circles() -> None:
    modules = {_module(p): p for p in FILES}
    graph = {m: _imports(p, set(modules)) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert circles == []


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Lines of code, docstrings and comments blanked."""
    text = path.read_text()
    tree = ast.parse(text)
    doc: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return [(i, line.split("#")[0]) for i, line in enumerate(text.splitlines(), 1) if i not in doc]


def test_torch_distributed_is_called_only_under_distributed() -> None:
    call = re.compile(r"\b(dist|torch\.distributed|c10d)\.(?!tensor\b|device_mesh\b|fsdp\b|pipelining\b)[a-z_]+\(")
    found = [f"{_relative(p)}:{i}" for p in FILES
             if not _relative(p).startswith(("distributed/", "demo/"))
             for i, line in _code_lines(p) if call.search(line)]
    assert found == []


def test_private_torch_names_only_in_torch_private() -> None:
    private = re.compile(r"\btorch(\.[A-Za-z]\w*)*\._[A-Za-z]"  # torch._C, torch.library._x
                         r"|\bfrom torch[\w.]* import .*\b_[A-Za-z]"  # from torch... import _StridedShard
                         r"|\._(spec|local_tensor|version|parameters|modules)\b")  # torch objects' internals
    found = [f"{_relative(p)}:{i}" for p in FILES if p.name != "torch_private.py"
             for i, line in _code_lines(p) if private.search(line)]
    assert found == []


def test_only_the_reporter_decides_which_rank_speaks() -> None:
    rank_zero = re.compile(r"(global_rank|get_rank\(\))\s*==\s*0")
    found = [f"{_relative(p)}:{i}" for p in FILES if p.name != "reporter.py" and not _relative(p).startswith("demo/")
             for i, line in _code_lines(p) if rank_zero.search(line)]
    assert found == []
