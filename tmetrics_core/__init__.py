"""tmetrics: training-time tensor metrics for sharded PyTorch models."""
