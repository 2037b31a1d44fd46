"""The README's training loop, stopped by Ctrl-C: ``python -m tests.reliability.interrupt_job RUN_DIR``.

No ``with`` around TensorMetrics and no ``finally``: ``metrics.close()`` after the loop is never
reached. The sinks are MLflow (the SQLite store ``RUN_DIR/mlflow.db``), W&B offline and
TensorBoard. Once every sink has opened the job writes ``RUN_DIR/ready``; it trains until
interrupted. Logging lines carry ``time.time()``, so the test can tell when the close ended.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import torch

import tmetrics_core as tm
from tests.reliability.layered_model import LayeredModel


def main(run_dir: Path) -> None:
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(name)s %(message)s")
    torch.set_num_threads(1)
    model = LayeredModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"run": {"name": "interrupted"}, "metrics": ["global-grad-l2", "layer-grad-l2"],
              "sinks": {"mlflow": {"tracking_uri": f"sqlite:///{run_dir / 'mlflow.db'}"},
                        "wandb": {"mode": "offline"}, "tensorboard": {}}}
    metrics = tm.TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=run_dir)
    ready = False
    for step in range(1, 1_000_001):
        with metrics.step(step):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        if not ready and all(s.opened for s in metrics.hub.report().sinks):
            ready = True
            (run_dir / "ready").write_text(str(step))
        time.sleep(0.01)
    metrics.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
