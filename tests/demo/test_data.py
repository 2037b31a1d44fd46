"""Byte corpus: which files, in which order, and deterministic global batches."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from tmetrics_core.demo.data import ByteCorpus, stdlib_files
from tmetrics_core.errors import ConfigError


def test_stdlib_files_are_sorted_python_sources_without_installed_packages() -> None:
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files)
    assert root / "os.py" in files and root / "json" / "decoder.py" in files
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


def test_stdlib_corpus_starts_with_the_first_file() -> None:
    files = stdlib_files()
    corpus = ByteCorpus.from_stdlib()
    head = files[0].read_bytes()
    assert len(corpus) == sum(f.stat().st_size for f in files) > 1_000_000
    assert bytes(corpus.data[: len(head)].tolist()) == head


def _counting_corpus(n: int = 1000) -> ByteCorpus:
    return ByteCorpus(torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8), source="counting")


def test_batches_are_windows_of_the_text() -> None:
    batch = _counting_corpus().batch(7, batch_size=5, seq_len=16, seed=1)
    assert batch.shape == (5, 17) and batch.dtype == torch.int64
    steps = (batch[:, 1:] - batch[:, :-1]).remainder(256)
    assert torch.equal(steps, torch.ones_like(steps))  # consecutive bytes of the text


def test_batches_depend_only_on_seed_and_step() -> None:
    corpus = _counting_corpus()
    first = corpus.batch(3, batch_size=4, seq_len=8, seed=2)
    corpus.batch(1, batch_size=4, seq_len=8, seed=2)  # an unrelated draw in between
    assert torch.equal(corpus.batch(3, batch_size=4, seq_len=8, seed=2), first)
    assert not torch.equal(corpus.batch(4, batch_size=4, seq_len=8, seed=2), first)
    assert not torch.equal(corpus.batch(3, batch_size=4, seq_len=8, seed=3), first)


def test_window_may_end_at_the_last_byte() -> None:
    corpus = ByteCorpus(torch.arange(9, dtype=torch.uint8), source="nine bytes")
    assert torch.equal(corpus.batch(1, batch_size=2, seq_len=8, seed=0), torch.arange(9).repeat(2, 1))


def test_from_path_reads_a_directory_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes(b"!")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    corpus = ByteCorpus.from_path(tmp_path)
    assert bytes(corpus.data.tolist()) == b"hello world!"
    assert bytes(ByteCorpus.from_path(tmp_path / "b.txt").data.tolist()) == b"world"


def test_errors_say_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as err:
        ByteCorpus.from_path(tmp_path / "missing")
    assert err.value.path == "--data"
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds no bytes"):
        ByteCorpus.from_path(tmp_path / "empty.txt")
    with pytest.raises(ConfigError, match="need at least seq_len"):
        _counting_corpus(10).batch(1, batch_size=1, seq_len=10, seed=0)
