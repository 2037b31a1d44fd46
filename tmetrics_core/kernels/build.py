"""Building the CPU kernels: one compiler call per source and toolchain, cached on disk.

Libraries are written under ``$TMETRICS_CACHE`` (default ``$XDG_CACHE_HOME/tmetrics`` or
``~/.cache/tmetrics``), in ``kernels/``, named by a key of everything that changes the build,
so a later process loads the library without compiling, and ranks of one node that race to
build it each write their own file and rename it into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

__all__ = ["build", "cache_dir", "compiler", "key", "version"]

_log = logging.getLogger("tmetrics.kernel")
_announced: list[Path] = []  # the cache directory, once the first build of the process has said so


def cache_dir() -> Path:
    """Where built kernels are kept."""
    root = os.environ.get("TMETRICS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tmetrics")
    return Path(root) / "kernels"


def compiler(variable: str, names: Sequence[str], language: str) -> list[str] | None:
    """The compiler command: ``$variable`` (which may carry flags, ``"gcc -O2"``, as make
    allows), else the first of ``names`` on the path; None, with one warning naming the
    ``language``'s compiler to install and the fallback, where there is none."""
    found = os.environ.get(variable) or next(filter(None, map(shutil.which, names)), None)
    if not found:
        _log.warning("no %s compiler found: tmetrics reads each CPU tensor once per statistic instead of once for all "
                     "(same numbers, slower). Install one (e.g. %s) or set %s; TMETRICS_FUSED_KERNEL=0 silences this",
                     language, names[-1], variable)
        return None
    return shlex.split(found)


def version(command: Sequence[str]) -> str:
    """What ``command --version`` prints (part of a library's key).

    Raises:
        OSError: the compiler cannot be run.
        subprocess.SubprocessError: it ran past 30 seconds.
    """
    return subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=30).stdout


def key(*parts: str) -> str:
    """A short hash of ``parts`` (sources, compiler versions, flags): a library's name."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def build(target: Path, commands: Sequence[Sequence[str]], timeout: float = 300) -> None:
    """Write the library ``target`` with the first of ``commands`` (compiler, flags, sources and
    libraries; the output option is added) that succeeds, atomically. The first build of the
    process says so once, with the cache directory.

    Raises:
        OSError: every command failed (the last one's error output, shortened).
        subprocess.SubprocessError: a command ran past ``timeout`` seconds.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    if not _announced:
        _announced.append(target.parent)
        # A warning, not info, so that it shows with no logging set up: the first due step
        # otherwise sits silent for 10 to 30 s and looks hung.
        _log.warning("tmetrics is compiling its CPU kernels (first use only; 10 to 30 s) into %s; later runs load "
                     "them from there (TMETRICS_CACHE moves it, TMETRICS_FUSED_KERNEL=0 skips the kernels)",
                     target.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    error = "no command given"
    try:
        for command in commands:
            done = subprocess.run([*command, "-o", tmp], capture_output=True, text=True, timeout=timeout)
            if done.returncode == 0 and os.path.getsize(tmp) > 0:
                os.replace(tmp, target)
                return
            error = done.stderr.strip()[-500:] or "no library written"
        raise OSError(f"{commands[-1][0]} failed: {error}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
