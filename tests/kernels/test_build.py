"""The kernel build says so once, with its cache directory (issue 35: the first due step sat
silent for 9 to 21 s while it compiled, and the demo looked hung)."""

from __future__ import annotations

import logging
import sys

from tmetrics_core.kernels import build

_WRITE = [sys.executable, "-c", "import sys; open(sys.argv[2], 'w').write('library')"]  # gets -o PATH


def test_the_first_build_of_a_process_is_announced_once_with_its_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(build, "_announced", [])
    caplog.set_level(logging.WARNING, logger="tmetrics.kernel")
    build.build(tmp_path / "cache" / "moments-1.so", [_WRITE])
    build.build(tmp_path / "cache" / "tensor-lists-1.so", [_WRITE])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "compiling its CPU kernels" in said[0] and str(tmp_path / "cache") in said[0]
    assert (tmp_path / "cache" / "moments-1.so").read_text() == "library"
