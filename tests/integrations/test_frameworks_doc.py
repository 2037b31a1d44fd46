"""The examples of docs/integrations/frameworks.md, run exactly as printed (each in its own
directory holding the doc's ``tmetrics.yaml``): each writes one record per metric per optimizer
step to its jsonl file, and each stays under 15 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integrations.tiny import by_step, read_jsonl

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations" / "frameworks.md"
TEXT = DOC.read_text()
YAML = re.search(r"```yaml\n(.*?)```", TEXT, flags=re.S).group(1)
EXAMPLES = re.findall(r"^## (.+?)\n.*?```python\n(.*?)```", TEXT, flags=re.S | re.M)


def test_one_example_per_framework_each_under_15_lines():
    assert [title for title, _ in EXAMPLES] == ["Hugging Face Trainer", "Lightning", "accelerate"]
    assert all(len(code.splitlines()) < 15 for _, code in EXAMPLES)


@pytest.mark.parametrize("title, code", EXAMPLES, ids=[title.split()[-1] for title, _ in EXAMPLES])
def test_example_runs_and_writes_records(title, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmetrics.yaml").write_text(YAML)
    exec(compile(code, f"{DOC.name}: {title}", "exec"), {"__name__": "__doc_example__"})
    run_dir = re.search(r'run_dir="([^"]+)"', code).group(1)
    steps = by_step(read_jsonl(tmp_path / run_dir))
    assert sorted(steps) == [1, 2]
    for records in steps.values():
        assert sorted(records) == sorted([("global-grad-l2", None)] + [(m, layer) for m in ("layer-grad-l2", "layer-param-l2")
                                                                      for layer in (0, 1)])
        assert all(value > 0 for value in records.values())
