"""What a run reports: metrics to JSONL + TensorBoard (+ W&B / trackio), a progress bar or heartbeat, plots.

metrics.py is the one place a step's metrics are written; progress.py is what a person watches;
plot.py turns a run directory's metrics.jsonl into a PNG dashboard.
"""
