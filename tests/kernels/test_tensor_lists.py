"""The C++ reader of the moments kernel's arguments: what it takes, what it refuses, and the
fused kernel's fallback where it cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tmetrics_core.kernels import moments, tensor_lists

CODES = {torch.float32: 0, torch.bfloat16: 1}


def test_packs_pointers_counts_and_dtype_codes_of_every_tensor() -> None:
    tensors = [torch.randn(3, 4), torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16)), torch.zeros(0),
               torch.randn(6, 2)[2:]]  # a contiguous view at an offset
    packed = tensor_lists.pack(tensors, CODES)
    assert packed is not None
    xs, ns, codes = packed
    assert list(xs[:2]) == [t.data_ptr() for t in tensors[:2]] and xs[3] == tensors[3].data_ptr()
    assert list(ns) == [12, 5, 0, 8] and list(codes) == [0, 1, 0, 0]
    assert tensor_lists.pack([], CODES) == (moments.array.array("Q"), moments.array.array("q"), moments.array.array("i"))


def test_refuses_any_list_with_a_tensor_the_kernel_cannot_read_as_flat_memory() -> None:
    ok = torch.randn(4, 4)
    freed = torch.randn(8)
    freed.untyped_storage().resize_(0)  # non-empty, its memory gone
    refused = {
        "transposed": ok.t(),
        "float64": ok.double(),
        "float16": ok.half(),
        "lazily negated": torch._neg_view(ok),
        "sparse": ok.to_sparse(),
        "freed storage": freed,
        "not a tensor": 3.0,
    }
    for what, bad in refused.items():
        assert tensor_lists.pack([ok, bad], CODES) is None, what  # type: ignore[list-item]
        assert tensor_lists.pack([bad], CODES) is None, what  # type: ignore[list-item]
    assert tensor_lists.pack([ok], CODES) is not None


def test_without_a_cxx_compiler_the_kernel_is_off_and_says_so(tmp_path) -> None:
    script = textwrap.dedent("""
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from tmetrics_core.topology import Topology
        from tmetrics_core.kernels import moments
        from tmetrics_core.metrics.statistics import SUMSQ
        from tmetrics_core.site import Site
        t = torch.arange(10.0)
        out = moments.statistic_vectors(SUMSQ, [t], [Site("t", "param", (10,))], Topology.single_process(), {})
        print("available", moments.available(), "takes", moments.takes(t), "sumsq", float(out[0]))
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-cxx"), TMETRICS_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "available False takes False sumsq 285.0" in done.stdout
    assert "C++ tensor-list reader is unavailable" in done.stderr and "results are the same" in done.stderr


def test_lists_of_accelerator_tensors_build_no_reader(monkeypatch) -> None:
    """Runs without CPU tensors never build the reader (a C++ build of some seconds): the meta
    device stands in for an accelerator."""
    from tmetrics_core.kernels import foreach_moments

    monkeypatch.setattr(tensor_lists, "_module", lambda: pytest.fail("the reader was built for accelerator tensors"))
    elsewhere = [torch.empty(3, 4, device="meta"), torch.empty(5, device="meta")]
    assert foreach_moments.rows(elsewhere).device.type == "meta"
    assert moments.copied(elsewhere) is None and moments._pack(elsewhere) is None
