"""Byte-level training text: the Python standard library's sources, or the user's own files.

Every machine with Python has the standard library, so the demo needs no download. Batches are a
pure function of ``(seed, step)``: the same GLOBAL batch on every topology, of which each
data-parallel rank takes its contiguous block of rows (``ParallelModel.local_rows``).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch

from tmetrics_core.errors import ConfigError

__all__ = ["ByteCorpus", "stdlib_files"]

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files, sorted by path; installed packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts))


class ByteCorpus:
    """One long byte string (file contents joined in sorted path order), sampled in windows.

    ``data`` is a uint8 tensor [n_bytes]; token ids are the byte values 0..255.
    """

    def __init__(self, data: torch.Tensor, *, source: str) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(f"data must be a 1-D uint8 tensor; got {data.dtype} of shape {tuple(data.shape)}")
        self.data = data
        self.source = source

    @classmethod
    def from_files(cls, files: Iterable[Path], *, source: str) -> ByteCorpus:
        """Join the bytes of ``files`` in the order given."""
        blob = bytearray(b"".join(Path(f).read_bytes() for f in files))
        data = torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
        return cls(data, source=source)

    @classmethod
    def from_stdlib(cls) -> ByteCorpus:
        """The standard library's Python sources (about 30 MB on CPython 3.11)."""
        return cls.from_files(stdlib_files(), source=f"Python standard library ({sysconfig.get_paths()['stdlib']})")

    @classmethod
    def from_path(cls, path: str | Path) -> ByteCorpus:
        """A file, or every regular file under a directory (recursively, sorted by path).

        Raises:
            ConfigError: ``path`` does not exist or holds no bytes.
        """
        root = Path(path)
        if not root.exists():
            raise ConfigError(f"{str(root)!r} does not exist; give a text file or a directory of them",
                              path="--data")
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        corpus = cls.from_files(files, source=str(root))
        if corpus.data.numel() == 0:
            raise ConfigError(f"{str(root)!r} holds no bytes; give a non-empty text file or directory",
                              path="--data")
        return corpus

    def __len__(self) -> int:
        return self.data.numel()

    def batch(self, step: int, *, batch_size: int, seq_len: int, seed: int) -> torch.Tensor:
        """The global batch of ``step``: [batch_size, seq_len + 1] int64 byte windows.

        Window starts are drawn uniformly from a generator seeded by ``(seed, step)``, so the
        batch does not depend on earlier calls. Inputs are ``[:, :-1]``, targets ``[:, 1:]``.

        Raises:
            ConfigError: the corpus is shorter than ``seq_len + 1`` bytes.
        """
        span = seq_len + 1
        if len(self) < span:
            raise ConfigError(f"the text has {len(self)} bytes; need at least seq_len + 1 = {span}",
                              path="--data")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self) - span + 1, (batch_size,), generator=gen)
        return self.data[starts[:, None] + torch.arange(span)].long()          # (B, T + 1)

