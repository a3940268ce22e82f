"""Run telemetry: the JSONL metrics stream (the source of truth), its W&B mirror, and progress bars.

Console lines (console.py: rank 0, any output, library noise filtered; run_report.py: a line per stage and
step) are for people. Every metric is written locally first (`metrics.jsonl`, one JSON object per step,
durable per step) so a run can be inspected, plotted (`megatron_qrl.plotting`) and resumed without W&B;
W&B is a mirror.
"""
from megatron_qrl.logging.metrics import MetricsLogger, read_metrics, sanitize_metrics, truncate_metrics
from megatron_qrl.logging.progress import progress_bar, progress_enabled
from megatron_qrl.logging.run_report import ProgressLines, RunReport, format_duration
from megatron_qrl.logging.wandb_sink import WandbSink, resolve_wandb_mode

__all__ = [
    "MetricsLogger",
    "ProgressLines",
    "RunReport",
    "WandbSink",
    "format_duration",
    "progress_bar",
    "progress_enabled",
    "read_metrics",
    "resolve_wandb_mode",
    "sanitize_metrics",
    "truncate_metrics",
]
