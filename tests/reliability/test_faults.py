"""Runtime faults on real gloo ranks (issue 8, item 2): non-finite gradients are counted and never
raised; empty shards and ranks without experts complete with the one-process values; a metric
raising on one rank is skipped on all with one warning; a rank-dependent plan fails fast on
every rank; a rank that never joins fails the step within the collective timeout.

The two-rank scenarios share one spawned job and the four-rank one another (see
``rank_scenarios``); the one-process references run here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_distributed
from tests.reliability import rank_scenarios as scenarios

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("two-ranks")
    return run_distributed(scenarios.two_rank_faults, 2, str(root), timeout=180), root


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("four-ranks")
    return run_distributed(scenarios.four_rank_uneven, 4, str(root), timeout=180)


def _one_process(config: dict[str, Any], steps: int, tmp_path: Path) -> dict[int, dict[tuple[Any, ...], Any]]:
    return scenarios.train({}, config, steps, run_dir=str(tmp_path / "one-process"))["records"]


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, tuple):
        return isinstance(got, tuple) and len(got) == len(want) and all(map(_same, got, want))
    if math.isnan(want):
        return math.isnan(got)
    return got == pytest.approx(want, rel=1e-5, abs=1e-12)


def _assert_records_equal(got: dict[tuple[Any, ...], Any], want: dict[tuple[Any, ...], Any]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    bad = {key: (got[key], want[key]) for key in want if not _same(got[key], want[key])}
    assert not bad


def _jsonl_values(run_dir: Path) -> dict[tuple[Any, ...], Any]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        labels = row["labels"]
        key = (row["step"], row["metric"], labels.get("layer"), labels.get("expert"), labels.get("tensor"),
               labels.get("stat"))
        assert key not in out, f"record written twice: {key}"
        out[key] = row["value"]
    return out


def test_nan_and_inf_in_gradients_are_counted_and_never_raised(two_ranks, tmp_path):
    results, root = two_ranks
    reference = _one_process(scenarios.TINY, 1, tmp_path)
    for rank, result in enumerate(results):
        run = result["nonfinite"]
        assert run["failures"] == []
        _assert_records_equal(run["records"][1], reference[1])  # before the fault: as on one process
        step2 = run["records"][2]
        counts = {(layer, stat): step2[("layer-grad-nonfinite", layer, None, None, stat)]
                  for layer in (0, 1) for stat in ("nan", "posinf", "neginf", "total")}
        assert counts == {(0, "nan"): 1, (0, "posinf"): 1, (0, "neginf"): 1, (0, "total"): 3,
                          (1, "nan"): 3, (1, "posinf"): 0, (1, "neginf"): 0, (1, "total"): 3}, rank
        assert math.isnan(step2[("global-grad-l2", None, None, None, None)])
        assert math.isnan(step2[("layer-grad-l2", 0, None, None, None)])
        assert math.isnan(step2[("layer-grad-l2", 1, None, None, None)])
        assert math.isnan(step2[("layer-grad-absmax", 0, None, None, None)])  # NaN wins over Inf, as in torch.max
        step3 = run["records"][3]  # the step after: the loop skipped the update and went on
        assert all(step3[("layer-grad-nonfinite", layer, None, None, "total")] == 0 for layer in (0, 1))
        assert math.isfinite(step3[("global-grad-l2", None, None, None, None)])
    # Counted in and out: every record of rank 0 is in metrics.jsonl once, with its value.
    report = results[0]["nonfinite"]["report"]
    submitted = sum(len(r) for r in results[0]["nonfinite"]["records"].values())
    assert (report.submitted, report.written, report.spooled, report.dropped) == (submitted, submitted, 0, 0)
    written = _jsonl_values(root / "nonfinite")
    assert len(written) == submitted
    assert written[(2, "layer-grad-nonfinite", 1, None, None, "nan")] == 3
    assert written[(2, "global-grad-l2", None, None, None, None)] == "NaN"


def test_pipeline_stage_without_experts_completes_with_one_process_values(two_ranks, tmp_path):
    results, root = two_ranks
    reference = _one_process(scenarios.TINY, 2, tmp_path)
    assert ("layer-expert-tokens", 1, None, None, None) not in reference[1]  # layer 1 is dense
    for result in results:
        run = result["pipeline"]
        assert run["failures"] == []
        for step in (1, 2):
            _assert_records_equal(run["records"][step], reference[step])
    assert len(_jsonl_values(root / "pipeline")) == results[0]["pipeline"]["report"].written


def test_empty_shards_complete_with_one_process_values(four_ranks, tmp_path):
    # 3 experts: the router weight has 3 rows, so the 4th rank's FSDP2 shard of it is empty
    assert "layers.0.moe.router.weight" in four_ranks[3]["empty_shards"]
    assert four_ranks[0]["empty_shards"] == []
    reference = _one_process(scenarios.UNEVEN, 2, tmp_path)
    for result in four_ranks:
        assert result["failures"] == []
        for step in (1, 2):
            _assert_records_equal(result["records"][step], reference[step])


def test_metric_raising_on_one_rank_is_skipped_everywhere_with_one_warning(two_ranks):
    results, _ = two_ranks
    both = ["flaky-grad-l2", "good-grad-l2"]
    for rank, result in enumerate(results):
        run = result["raising"]
        assert run["names"] == {1: both, 2: ["good-grad-l2"], 3: ["good-grad-l2"], 4: both, 5: both}, rank
        assert run["failures"] == [("flaky-grad-l2", (1,)), ("flaky-grad-l2", (1,))]
    assert results[0]["raising"]["warnings"] == [
        "tmetrics: metric 'flaky-grad-l2' skipped at step 2 on every rank (raised on ranks [1]): ValueError: "
        "injected failure on rank 1. Further failures of this metric are counted silently."
    ]
    assert results[1]["raising"]["warnings"] == []  # rank 1 does not log (rank 0 does, with rank 1's error)


def test_rank_asymmetric_plan_raises_plan_mismatch_fast_on_every_rank(two_ranks):
    results, _ = two_ranks
    for result in results:
        run = result["asymmetric"]
        assert (run["error"], run["metric"], run["axis"], run["ranks"]) == ("PlanMismatchError", "layer-grad-l2",
                                                                            "dp", (1,))
        assert "rank 1 has nothing" in run["message"] and "select patterns" in run["message"]
        assert run["seconds"] < 5


def test_a_rank_that_never_joins_fails_the_step_within_the_collective_timeout(two_ranks):
    results, _ = two_ranks
    absent = results[0]["absent"]
    assert absent["error"] == "TMetricsError"
    assert absent["message"].startswith("a tmetrics all_reduce(max) did not complete within 3 s (")
    assert "some rank never joined it" in absent["message"]
    assert 3.0 <= absent["seconds"] < 6.0
    assert results[1]["absent"] == {"error": None}


def test_token_placement_a_metric_cannot_handle_is_skipped_everywhere_with_the_reason(two_ranks):
    """Token sites exist only once the model runs, so their placements are checked there: expert
    counts need whole top-k rows, and here the ids are split over ``tp``."""
    results, _ = two_ranks
    reason = ("PlacementError: expert_counts: router_topk is split by expert (Shard(1) on axis 'tp') but this "
              "metric needs each token's full row; got layers.0.moe.expert_indices [router_topk] (-1, 2) tp=S1. "
              "Observe the router tensors replicated on that axis (tm.observe without shard_dim): they are small")
    for result in results:
        run = result["router_split"]
        assert run["failures"] == [("layer-expert-tokens", (0, 1), reason)]
        assert list(run["records"]) == [("layer-router-logits-l2", 0)]  # a sum over the split is fine
        assert run["records"][("layer-router-logits-l2", 0)] == pytest.approx(run["reference_l2"], rel=1e-6)
    assert results[0]["router_split"]["warnings"] == [
        f"tmetrics: metric 'layer-expert-tokens' skipped at step 1 on every rank (raised on ranks [0, 1]): {reason}. "
        "Further failures of this metric are counted silently."
    ]
    assert results[1]["router_split"]["warnings"] == []
