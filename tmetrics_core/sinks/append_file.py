"""An append-only file whose appends are all-or-nothing.

Shared by the spool (``tmetrics_core.hub.spool``) and the ``jsonl`` sink, whose readers must never
see half a batch: a write that fails part-way (disk full, I/O error) is cut back to where it
started, so a retry cannot duplicate lines and a reader sees either the whole batch or none.
A line left torn by a killed process is closed with a newline when the file is opened again,
so the next append starts on a line of its own.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["AppendFile"]


class AppendFile:
    """One file opened for appending bytes, with ``fsync`` on :meth:`flush`.

    Not thread-safe: one writer thread per file. Uses ``os.write`` on an ``O_APPEND``
    descriptor, with no Python-level buffer, so an append is on its way to the OS when
    :meth:`append` returns.

    Args:
        path: the file; missing parent directories are created on :meth:`open`.
    """

    __slots__ = ("path", "_fd")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> bool:
        """Open (creating the file and its directory if needed); returns True when the file is
        empty, so a caller can write a header first. Idempotent.

        Raises:
            OSError: the directory or file cannot be created or opened.
        """
        if self._fd is not None:
            return os.fstat(self._fd).st_size == 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
                _write_all(fd, b"\n")  # isolate a torn last line left by a killed writer
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return size == 0

    def append(self, data: bytes) -> None:
        """Append ``data`` entirely, or not at all.

        Raises:
            OSError: the write failed (e.g. ``ENOSPC``); the file was cut back to its previous
                length where the file system allows it (a device such as ``/dev/full`` does not).
            ValueError: the file is not open.
        """
        fd = self._require_open()
        start = os.fstat(fd).st_size
        try:
            _write_all(fd, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise

    def flush(self) -> None:
        """Make appended data durable (``fsync``).

        Raises:
            OSError: the OS reported a write-back error.
            ValueError: the file is not open.
        """
        os.fsync(self._require_open())

    def close(self) -> None:
        """Close the descriptor (no ``fsync``; call :meth:`flush` first). Idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _require_open(self) -> int:
        if self._fd is None:
            raise ValueError(f"AppendFile({str(self.path)!r}) is not open; call open() first")
        return self._fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
