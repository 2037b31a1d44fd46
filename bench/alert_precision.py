"""Precision and delay of ``alerts: default`` on the demo: its injections and clean seeds.

    python -m bench.alert_precision [--steps 120] [--seeds 0 1 2] [--out runs/alert-precision] [--reuse]

Runs the demo (one process, metrics every 5 steps, the ``jsonl`` sink only) once per clean seed
and once per injection (seed 0), then feeds each run's ``metrics.jsonl`` through a fresh
:class:`~tmetrics_core.alerts.AlertEngine` with ``alerts: default``: the records the live engine
saw, so a rule change is measured again with ``--reuse`` and no new training.

Per run it prints every alert opened and sorts it:

- **detection**: the first alert at or after an injection's start step that names the injected
  layer (and expert); its delay counts the due steps of its metric from the first one at or after
  the start step (0: named at the first due step of the fault);
- **caused**: an alert within ``CLUSTER`` steps after the detection that is not on tokens per
  expert, or is on the injected expert (the gradient-norm spikes of the layers below a
  learning-rate spike; ``starved-expert`` on the expert that ``dead-expert`` named);
- **recovery**: a spike alert after an injection whose value is within ``RECOVERY`` x its
  series' median before the injection (the line gives that ratio and the jump over the rule's
  baseline): the value is back within the layer's healthy range, and the rule tripped because
  its baseline (the median of the last 20 due values, 100 steps) fell below that range after
  the injection; the injection's aftermath, not a false alarm;
- **starvation**: an alert on tokens per expert whose expert was below ``STARVED`` x its layer's
  mean at the alert step: a genuinely starved expert (the demo's router starves experts by
  itself), a true alarm; the line says whether the expert got 0 tokens at some due step;
- **false**: anything else.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

from tmetrics_core.alerts import AlertEngine
from tmetrics_core.alerts.alert import Alert
from tmetrics_core.config.alerts import parse_alerts
from tmetrics_core.demo.train import INJECTIONS
from tmetrics_core.hub.spool import SpoolReader
from tmetrics_core.records import MetricRecord

STARVED = 0.1
"""An expert below this fraction of its layer's mean tokens counts as genuinely starved."""

CLUSTER = 10
"""Steps after a detection within which other alerts count as its consequences."""

RECOVERY = 10.0
"""A spike alert after an injection whose value is at most this many times its series' median
before the injection is a recovery (the default spike rules' factor: against the healthy
baseline it would not have tripped)."""

CONFIG = {
    "run": {"name": "alert-precision"},
    "metrics": ["global-grad-l2:1", "layer-grad-l2:5", "layer-update-ratio:5", "layer-grad-nonfinite:1",
                "layer-expert-tokens:5", "layer-expert-load-imbalance:5", "layer-dead-experts:5"],
    "alerts": "default",
    "sinks": {"jsonl": {}},
}


def run_demo(run_dir: Path, *, steps: int, seed: int, inject: str | None, reuse: bool) -> None:
    """One demo run into ``run_dir`` (skipped with ``reuse`` when its metrics.jsonl exists)."""
    if reuse and (run_dir / "metrics.jsonl").exists():
        return
    config = run_dir.parent / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(CONFIG))
    command = [sys.executable, "-m", "tmetrics_core.demo", "--steps", str(steps), "--seed", str(seed),
               "--config", str(config), "--run-dir", str(run_dir)] + (["--inject", inject] if inject else [])
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")


def replay(run_dir: Path) -> tuple[list[Alert], dict[int, list[MetricRecord]]]:
    """The alerts ``alerts: default`` opens over the run's records, and the records by step."""
    steps: dict[int, list[MetricRecord]] = collections.defaultdict(list)
    for entry in SpoolReader(run_dir / "metrics.jsonl"):
        if isinstance(entry, MetricRecord):
            steps[entry.step].append(entry)
    engine = AlertEngine(parse_alerts("default"))
    for step in sorted(steps):
        engine.observe(steps[step], step)
    return [a for a in engine.history if a.state == "open"], steps


def _shares(steps: dict[int, list[MetricRecord]], layer: int, expert: int) -> dict[int, float]:
    out = {}
    for step, records in steps.items():
        for r in records:
            if r.metric == "layer-expert-tokens" and r.labels.layer == layer and isinstance(r.value, tuple):
                mean = sum(r.value) / len(r.value)
                out[step] = r.value[expert] / mean if mean else 0.0
    return out


def _reached_zero(shares: dict[int, float], step: int) -> bool:
    """Whether the expert got 0 tokens in its run of starved due steps around ``step``."""
    order = sorted(shares)
    i = j = order.index(step)
    while i > 0 and shares[order[i - 1]] < STARVED:
        i -= 1
    while j + 1 < len(order) and shares[order[j + 1]] < STARVED:
        j += 1
    return any(shares[s] == 0.0 for s in order[i:j + 1])


def recovery(alert: Alert, steps: dict[int, list[MetricRecord]], start: int) -> float | None:
    """The spike alert's value over its series' median before ``start`` (the injection), or None
    when it is no spike alert or its series has no value before ``start``."""
    if alert.baseline is None or alert.step < start or not alert.rule.endswith("-spike"):
        return None
    before = sorted(float(r.value) for step, records in steps.items() if step < start for r in records
                    if r.metric == alert.metric and r.labels == alert.labels and isinstance(r.value, (int, float)))
    if not before:
        return None
    healthy = before[len(before) // 2]
    return alert.value / healthy if healthy else float("inf")


def _due_delay(steps: dict[int, list[MetricRecord]], metric: str, start: int, step: int) -> int:
    due = sorted(s for s, records in steps.items() if s >= start and any(r.metric == metric for r in records))
    return due.index(step)


def judge(run_dir: Path) -> dict:
    """The run's alerts sorted into detection, starvation and false alarms (see the module doc)."""
    opened, steps = replay(run_dir)
    inject = json.loads((run_dir / "demo.json").read_text())["train"].get("inject")
    detection = None
    if inject:
        expert = inject["expert"] if inject["kind"] == "dead-expert" else None
        detection = next((a for a in opened if a.step >= inject["start_step"] and a.labels.layer == inject["layer"]
                          and (expert is None or a.labels.expert == expert)), None)
    def is_caused(alert: Alert) -> bool:
        return (detection is not None and alert is not detection
                and detection.step <= alert.step <= detection.step + CLUSTER
                and (alert.metric != "layer-expert-tokens"
                     or (alert.labels.layer, alert.labels.expert) == (detection.labels.layer, detection.labels.expert)))
    caused = [a for a in opened if is_caused(a)]
    # A recovery is a return to health of a series the injection moved: one the detection or a
    # caused alert named; a spike elsewhere stays a false alarm.
    moved = {(a.metric, a.labels) for a in caused + ([detection] if detection is not None else [])}
    starved, false, recovered = [], [], []
    for alert in opened:
        if alert is detection or is_caused(alert):
            continue
        layer, expert = alert.labels.layer, alert.labels.expert
        ratio = recovery(alert, steps, inject["start_step"]) if (alert.metric, alert.labels) in moved else None
        if ratio is not None and ratio <= RECOVERY:
            recovered.append((alert, ratio))
            continue
        if alert.metric == "layer-expert-tokens" and layer is not None and expert is not None:
            shares = _shares(steps, layer, expert)
            if shares[alert.step] < STARVED:
                starved.append((alert, _reached_zero(shares, alert.step)))
                continue
        false.append(alert)
    delay = None
    if inject and detection is not None:
        delay = _due_delay(steps, detection.metric, inject["start_step"], detection.step)
    return {"inject": inject, "opened": opened, "detection": detection, "delay": delay, "caused": caused,
            "starved": starved, "false": false, "recovered": recovered}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/alert-precision"))
    parser.add_argument("--reuse", action="store_true", help="Reuse runs whose metrics.jsonl exists.")
    args = parser.parse_args(argv)
    cases = [(f"clean-{s}", s, None) for s in args.seeds] + [(kind, 0, kind) for kind in INJECTIONS]
    print(f"{args.steps} steps, metrics every 5, alerts: default")
    print("| run | alerts opened | detection (delay, due steps) | caused by it | starved experts (true) "
          "| false alarms |")
    print("|---|---|---|---|---|---|")
    for name, seed, inject in cases:
        run_dir = args.out / name
        run_demo(run_dir, steps=args.steps, seed=seed, inject=inject, reuse=args.reuse)
        result = judge(run_dir)
        found = result["detection"]
        if inject:
            where = f"step {result['inject']['start_step']}: " + (
                f"{found.rule} layer {found.labels.layer}"
                + (f" expert {found.labels.expert}" if found.labels.expert is not None else "")
                + f" at step {found.step} (delay {result['delay']})" if found else "missed")
        else:
            where = "-"
        starved = "; ".join(f"{a.rule} L{a.labels.layer} E{a.labels.expert} step {a.step}"
                            + (" (0 tokens)" if zero else "") for a, zero in result["starved"]) or "-"
        caused = "; ".join([f"{a.rule} {a.labels.where()} step {a.step}" for a in result["caused"]]
                           + [f"{a.rule} {a.labels.where()} step {a.step} (recovery: {ratio:.2g}x its median before "
                              f"the injection, {a.jump:.3g}x its baseline)" for a, ratio in result["recovered"]]) or "-"
        false = "; ".join(f"{a.rule} {a.metric} {a.labels.where()} step {a.step}" for a in result["false"]) or "0"
        print(f"| {name} | {len(result['opened'])} | {where} | {caused} | {starved} | {false} |")


if __name__ == "__main__":
    main()
