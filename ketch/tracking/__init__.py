"""Where metrics go: `metrics.jsonl`, `samples.jsonl` and the console (`metrics.py`), and the trackers chosen in
`trainer.logger`, TensorBoard, Weights & Biases and MLflow (`backends.py`, each library imported only when
chosen)."""

from ketch.tracking.metrics import Tracker, TrackerError, format_step_line, info, read_metrics, read_records

__all__ = ["Tracker", "TrackerError", "format_step_line", "info", "read_metrics", "read_records"]
