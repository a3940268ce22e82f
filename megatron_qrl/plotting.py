"""`qrl plot RUN_DIR`: PNG charts of a run's metrics.jsonl (reward, mismatch, AIS, AQN, throughput).

Reads only the local JSONL stream, so it works for offline runs, on a login node, and after W&B is gone.
A chart whose metrics the run never logged is skipped, a panel likewise; null (non-finite) values are gaps.
Figures go to RUN_DIR/plots/ (or --out).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_qrl.logging.metrics import METRICS_FILE, read_metrics


class MetricsNotFoundError(FileNotFoundError):
    """The run directory has no metrics.jsonl (wrong path, or the run never reached its first step)."""


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    ylabel: str = ""
    log_y: bool = False
    std_of: dict = field(default_factory=dict)  # mean key -> std key drawn as a +-1 std band


@dataclass(frozen=True)
class Chart:
    name: str
    title: str
    panels: tuple[Panel, ...]


CHARTS: tuple[Chart, ...] = (
    Chart("reward", "Reward", (
        Panel("reward (mean ± std over responses)", ("reward/mean",), "reward",
              std_of={"reward/mean": "reward/std"}),
        Panel("eval accuracy", ("eval/accuracy",), "accuracy"),
    )),
    Chart("mismatch", "Rollout/train mismatch", (
        Panel("|logp_rollout - logp_train| per token", ("mismatch/logp_abs_diff",), "nats", log_y=True),
        Panel("TRACE rounding-code mismatch", ("trace/code_mismatch_before", "trace/code_mismatch_after"),
              "fraction of codes"),
    )),
    Chart("ais", "Adaptive importance sampling", (
        Panel("alpha", ("ais/alpha",), "alpha"),
        Panel("alpha factors", ("ais/alpha_ess", "ais/alpha_mis", "ais/alpha_var"), "factor"),
        Panel("IS weight mean", ("is/weight_mean",), "weight"),
    )),
    Chart("aqn", "Adaptive quantization noise", (
        Panel("AQN sigma", ("aqn/sigma",), "sigma", log_y=True),
    )),
    Chart("throughput", "Throughput", (
        Panel("rollout tokens/s", ("rollout/tokens_per_s",), "tokens/s"),
        Panel("train step time", ("train/step_s",), "s"),
        Panel("weight sync time", ("sync/s",), "s"),
    )),
)


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one key; None (non-finite when logged) becomes NaN so lines show a gap."""
    steps, values = [], []
    for rec in records:
        if key in rec and isinstance(rec.get("step"), (int, float)):
            value = rec[key]
            steps.append(rec["step"])
            values.append(float(value) if isinstance(value, (int, float)) else math.nan)
    return steps, values


def _present(records: list[dict], keys: Sequence[str]) -> list[str]:
    return [k for k in keys if any(k in r for r in records)]


def _draw_panel(ax, records: list[dict], panel: Panel) -> None:
    for key in _present(records, panel.keys):
        steps, values = _series(records, key)
        (line,) = ax.plot(steps, values, label=key, marker="." if len(steps) < 50 else None)
        std_key = panel.std_of.get(key)
        if std_key and any(std_key in r for r in records):
            by_step = dict(zip(*_series(records, std_key)))
            std = [by_step.get(s, math.nan) for s in steps]
            low = [v - d for v, d in zip(values, std)]
            high = [v + d for v, d in zip(values, std)]
            ax.fill_between(steps, low, high, alpha=0.25, color=line.get_color(), label=f"± {std_key}")
    if panel.log_y and all(v > 0 for k in panel.keys for v in _series(records, k)[1] if not math.isnan(v)):
        ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_chart(records: list[dict], chart: Chart, out_dir: Path) -> Optional[Path]:
    import matplotlib.pyplot as plt

    panels = [p for p in chart.panels if _present(records, p.keys)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _draw_panel(ax, records, panel)
    fig.suptitle(chart.title)
    fig.tight_layout()
    path = out_dir / f"{chart.name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path, out_dir: Optional[str | Path] = None) -> list[Path]:
    """Write one PNG per chart that has data; returns their paths (empty if no known metric was logged)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works on headless nodes and never opens a window
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise MetricsNotFoundError(
            f"no {METRICS_FILE} in '{run_dir}': pass the run's output directory (run.output_dir), "
            "where the training loop writes metrics.jsonl from its first step on")
    records = read_metrics(metrics_path)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    return [p for chart in CHARTS if (p := _plot_chart(records, chart, out)) is not None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `qrl plot` (megatron_qrl/cli.py calls this, then `run`)."""
    parser.add_argument("run_dir", help="a run's output directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="where to write PNGs (default RUN_DIR/plots)")


def run(args: argparse.Namespace) -> int:
    """Body of `qrl plot`: prints the written paths; exit status 2 when there is no metrics.jsonl."""
    try:
        paths = plot_run(args.run_dir, args.out)
    except MetricsNotFoundError as err:
        print(f"qrl plot: error: {err}", file=sys.stderr)
        return 2
    if not paths:
        print(f"qrl plot: {args.run_dir}/{METRICS_FILE} holds none of the plotted metrics (docs/metrics.md)")
    for path in paths:
        print(path)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m megatron_qrl.plotting RUN_DIR [--out DIR]`, the same as `qrl plot`."""
    parser = argparse.ArgumentParser(prog="qrl plot", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
