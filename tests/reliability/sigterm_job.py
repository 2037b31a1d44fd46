"""A training job to be killed: ``python -m tests.reliability.sigterm_job RUN_DIR``.

TensorMetrics comes from a config with the ``jsonl`` sink and an MLflow sqlite store in RUN_DIR.
After each completed step the job appends that step's records to ``RUN_DIR/produced.jsonl``
(the records handed to the sinks, in the jsonl line format) and then the step number to
``RUN_DIR/progress``, both flushed. It trains until it is killed (at most 100,000 steps).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tests.reliability.layered_model import LayeredModel
from tmetrics_core.tensor_metrics import TensorMetrics

METRICS = ["global-grad-l2", "layer-grad-l2", "layer-grad-histogram", "layer-param-rms"]


def main(run_dir: Path) -> None:
    torch.set_num_threads(1)
    model = LayeredModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"run": {"name": "sigterm"}, "metrics": METRICS,
              "sinks": {"jsonl": {}, "mlflow": {"tracking_uri": f"sqlite:///{run_dir / 'mlflow.db'}",
                                                "experiment": "sigterm"}}}
    metrics = TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=run_dir)
    with open(run_dir / "produced.jsonl", "a") as produced, open(run_dir / "progress", "a") as progress:
        for step in range(1, 100_001):
            with metrics.step(step):
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            produced.write("".join(json.dumps({"step": r.step, "metric": r.metric, "labels": r.labels.as_dict(),
                                               "value": r.value_json()}) + "\n" for r in metrics.last_records))
            produced.flush()
            progress.write(f"{step}\n")
            progress.flush()
            time.sleep(0.01)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
