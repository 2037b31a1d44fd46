"""``tmetrics --help`` answers without importing torch (issue 35: it took 3 s, all of it torch's
import); the lazy ``demo`` command still loads and shows its own options."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from tmetrics_core.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
_HELP = """
import sys
from tmetrics_core.cli.main import main
try:
    main(["--help"], prog_name="tmetrics")
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "numpy", "mlflow", "wandb") if m in sys.modules)
print("imported:", heavy)
"""


def test_help_imports_no_torch_and_answers_under_a_second():
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _HELP], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""})
    took = time.monotonic() - started
    print(f"tmetrics --help: {took:.2f} s")
    assert done.returncode == 0, done.stderr
    assert "imported: []" in done.stdout
    assert all(name in done.stdout for name in ("demo", "metrics", "validate", "compare", "replay"))
    assert "Train the demo MoE transformer" in done.stdout
    assert took < 1.0


def test_the_lazy_demo_command_loads_with_its_options():
    result = CliRunner().invoke(main, ["demo", "--help"])
    assert result.exit_code == 0, result.output
    assert "--inject" in result.output and "--nproc" in result.output
