"""The evidence campaign: FP4 RL arms x seeds on the tiny MoE, then one table and plots (docs/RESULTS.md).

    python tools/evidence.py run [--seeds 0 1 2] [--arms ...]   # SFT per seed, every arm, aggregate
    python tools/evidence.py aggregate                          # table + PNGs from finished runs only

Layout under --root (default runs/evidence): `sft_seed{k}/` holds the seed's SFT warm start
(checkpoints/step_000000) and `sft_eval.json` (its held-out accuracy through the FP4 and the BF16 engine);
`seed{k}/{arm}/` is one RL run (metrics.jsonl, config.yaml, train.log, DONE). Every RL run starts from its
seed's SFT checkpoint with run.init_checkpoint and run.sft_steps=0, so the arms of one seed share their
starting weights exactly (`check-init` hashes them per arm). Runs go one at a time, each in its own process;
a finished run (DONE present) is skipped, an unfinished one is started again from scratch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import yaml

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "configs/evidence/base.yaml"
ARMS = REPO / "configs/evidence/arms.yaml"
DONE = "DONE"

# table columns: (metric key, how a run's series is reduced, header)
RUN_MEANS = (("mismatch/logp_abs_diff", "mismatch/logp_abs_diff"),
             ("trace/code_mismatch_before", "trace code mismatch before"),
             ("trace/code_mismatch_after", "trace code mismatch after"),
             ("ais/alpha", "ais/alpha"),
             ("is/truncated_frac", "is/truncated_frac"),
             ("rollout/tokens_per_s", "rollout tokens/s"),
             ("train/step_s", "train/step_s"))


# ------------------------------------------------------------------------------------------ configs
def load_arms(path: Path = ARMS) -> dict[str, list[str]]:
    arms = yaml.safe_load(Path(path).read_text())
    if not isinstance(arms, dict) or not all(isinstance(v, list) for v in arms.values()):
        raise ValueError(f"{path} must map each arm name to a list of dotted overrides")
    return arms


def seed_overrides(seed: int) -> list[str]:
    """Everything random follows the seed: data order and eval split, SFT init, sampling, AQN draws."""
    return [f"run.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}", f"trainer.seed={1234 + seed}"]


def sft_dir(root: Path, seed: int) -> Path:
    return root / f"sft_seed{seed}"


def sft_checkpoint(root: Path, seed: int) -> Path:
    return sft_dir(root, seed) / "checkpoints/step_000000"


def run_dir(root: Path, seed: int, arm: str) -> Path:
    return root / f"seed{seed}" / arm


def arm_overrides(root: Path, seed: int, arm: str, arms: dict, steps: Optional[int]) -> list[str]:
    extra = [f"run.total_steps={steps}"] if steps else []
    return (seed_overrides(seed) + [f"run.output_dir={run_dir(root, seed, arm)}", "run.sft_steps=0",
                                    f"run.init_checkpoint={sft_checkpoint(root, seed)}"] + extra + arms[arm])


def child_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), WANDB_MODE="disabled",
               QRL_NO_PROGRESS="1")
    env.setdefault("TRITON_INTERPRET", "1")  # no GPU on the campaign's box; megatron imports triton
    return env


# ---------------------------------------------------------------------------------- in-process jobs
def _setup(overrides: Sequence[str]):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron_qrl.config import load_config
    from megatron_qrl.pipeline import RunSetup

    cfg = load_config(str(BASE), list(overrides))
    return cfg, RunSetup.build(cfg)


def weights_digest(trainer) -> str:
    """sha256 over the trainer's fp32 parameters, in name order (the RL run's starting point)."""
    from megatron_qrl.pipeline.weight_sync import unwrap

    h = hashlib.sha256()
    for chunk in unwrap(trainer.model):
        for name, p in sorted(chunk.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def job_sft(root: Path, seed: int) -> None:
    """SFT warm start once for the seed, saved as step 0; held-out accuracy through both engines."""
    from megatron_qrl.pipeline import evaluate, resume_or_warm_start, save_checkpoint, sync_weights
    from megatron_qrl.rollout.embedded import EmbeddedEngine

    out = sft_dir(root, seed)
    if out.exists():
        shutil.rmtree(out)
    cfg, s = _setup(seed_overrides(seed) + [f"run.output_dir={out}", "aqn.enabled=false"])
    t0 = time.time()
    resume_or_warm_start(s)
    sft_s = time.time() - t0
    save_checkpoint(s, 0)
    result = {"seed": seed, "sft_steps": cfg.run.sft_steps, "sft_s": sft_s, "sft_loss": float(s.extra["sft/loss"]),
              "weights_sha256": weights_digest(s.trainer)}
    bf16_cfg = cfg.model_copy(deep=True)
    bf16_cfg.rollout.weights, bf16_cfg.trace.enabled = "bf16", False
    for name, c, engine in (("nvfp4", cfg, s.engine_ready()), ("bf16", bf16_cfg, EmbeddedEngine(bf16_cfg))):
        sync_weights(engine, s.trainer, c, step=0, version=0)
        ev = evaluate(engine, s.tokenizer, s.eval_set, cfg.rollout.max_new_tokens, s.reward_fn,
                      cfg.data.reward_time_limit_s)
        result[f"eval_accuracy_{name}"] = ev["eval/accuracy"]
    _write_json(out / "sft_eval.json", result)
    print(json.dumps(result))


def job_init_hash(root: Path, seed: int, arm: str) -> None:
    """The weights an arm's RL run starts from (same loading path as `qrl train`)."""
    from megatron_qrl.pipeline import resume_or_warm_start

    overrides = arm_overrides(root, seed, arm, load_arms(), None)
    overrides = [o for o in overrides if not o.startswith("run.output_dir=")]
    overrides.append(f"run.output_dir={root}/init_check/seed{seed}/{arm}")  # no checkpoint there: init path
    _, s = _setup(overrides)
    resume_or_warm_start(s)
    print("WEIGHTS", weights_digest(s.trainer))


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- campaign
def _run_logged(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())


def ensure_sft(root: Path, seed: int) -> None:
    if (sft_dir(root, seed) / "sft_eval.json").is_file():
        return
    log = root / f"logs/sft_seed{seed}.log"
    t0 = time.time()
    rc = _run_logged([sys.executable, __file__, "sft", "--root", str(root), "--seed", str(seed)], log)
    if rc:
        raise SystemExit(f"SFT for seed {seed} failed (rc {rc}); see {log}")
    print(f"[evidence] sft seed {seed}: {time.time() - t0:.0f} s", flush=True)


def ensure_run(root: Path, seed: int, arm: str, arms: dict, steps: Optional[int]) -> None:
    out = run_dir(root, seed, arm)
    if (out / DONE).is_file():
        return
    if out.exists():
        shutil.rmtree(out)  # an interrupted run starts over: every arm's record is one uninterrupted process
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "megatron_qrl.launch.train", "--config", str(BASE),
           *arm_overrides(root, seed, arm, arms, steps)]
    t0 = time.time()
    rc = _run_logged(cmd, out / "train.log")
    wall = time.time() - t0
    if rc:
        raise SystemExit(f"run seed {seed} arm {arm} failed (rc {rc}); see {out / 'train.log'}")
    _write_json(out / DONE, {"wall_s": wall, "command": cmd})
    print(f"[evidence] seed {seed} {arm}: {wall:.0f} s", flush=True)


def check_init(root: Path, seed: int, arms: Iterable[str]) -> dict:
    """Hash each arm's starting weights in its own process; all must equal the SFT checkpoint's."""
    result = {"seed": seed, "sft": json.loads((sft_dir(root, seed) / "sft_eval.json").read_text())["weights_sha256"]}
    for arm in arms:
        proc = subprocess.run([sys.executable, __file__, "init-hash", "--root", str(root), "--seed", str(seed),
                               "--arm", arm], cwd=REPO, env=child_env(), capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("WEIGHTS ")]
        if proc.returncode or not line:
            raise SystemExit(f"init-hash {arm} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        result[arm] = line[-1].split()[1]
    result["identical"] = len(set(v for k, v in result.items() if k != "seed")) == 1
    _write_json(root / f"init_check_seed{seed}.json", result)
    return result


# ------------------------------------------------------------------------------------- aggregation
def read_records(path: Path) -> list[dict]:
    from megatron_qrl.logging.metrics import read_metrics

    return read_metrics(path)


def finite(values: Iterable) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n-1; 0 for one value); NaN for none."""
    vals = finite(values)
    if not vals:
        return math.nan, math.nan
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def summarize_run(records: list[dict], last_n: int) -> dict:
    """One run's numbers: eval accuracy per eval step and at the last one, reward over the last N steps,
    means over all steps of the mismatch/TRACE/throughput metrics (NaN where the run never logged them)."""
    records = sorted(records, key=lambda r: r["step"])
    evals = {int(r["step"]): float(r["eval/accuracy"]) for r in records if finite([r.get("eval/accuracy")])}
    rewards = finite(r.get("reward/mean") for r in records)
    out = {"steps": len(records), "eval": evals,
           "final_eval": evals[max(evals)] if evals else math.nan,
           "reward_last": sum(rewards[-last_n:]) / len(rewards[-last_n:]) if rewards else math.nan,
           "reward": {int(r["step"]): float(r["reward/mean"]) for r in records if finite([r.get("reward/mean")])},
           "mismatch": {int(r["step"]): float(r["mismatch/logp_abs_diff"]) for r in records
                        if finite([r.get("mismatch/logp_abs_diff")])}}
    for key, _ in RUN_MEANS:
        vals = finite(r.get(key) for r in records)
        out[key] = sum(vals) / len(vals) if vals else math.nan
    return out


def collect(root: Path, arms: Sequence[str], seeds: Sequence[int], last_n: int) -> dict:
    """{arm: {seed: summary}} over finished runs (DONE present)."""
    out: dict = {}
    for arm in arms:
        for seed in seeds:
            d = run_dir(root, seed, arm)
            if (d / DONE).is_file():
                out.setdefault(arm, {})[seed] = summarize_run(read_records(d / "metrics.jsonl"), last_n)
    return out


def aggregate(runs: dict) -> dict:
    """{arm: {column: (mean, std), 'n': seeds, 'eval_steps': {step: (mean, std)}}} over seeds."""
    table = {}
    for arm, by_seed in runs.items():
        s = list(by_seed.values())
        row = {"n": len(s), "final_eval": mean_std([x["final_eval"] for x in s]),
               "reward_last": mean_std([x["reward_last"] for x in s])}
        for key, _ in RUN_MEANS:
            row[key] = mean_std([x[key] for x in s])
        steps = sorted(set().union(*(x["eval"] for x in s)))
        row["eval_steps"] = {st: mean_std([x["eval"].get(st, math.nan) for x in s]) for st in steps}
        table[arm] = row
    return table


def paired_diffs(runs: dict, ref: str, keys: Sequence[str] = ("final_eval", "reward_last")) -> dict:
    """{arm: {key: (mean, std) over seeds of arm - ref}} on the seeds both finished. Arms of one seed share
    the SFT start, the prompts and the sampling seeds (common random numbers), so the per-seed difference
    is far less noisy than comparing two arms' spreads over seeds."""
    out = {}
    for arm, by_seed in runs.items():
        if arm == ref or ref not in runs:
            continue
        common = sorted(set(by_seed) & set(runs[ref]))
        out[arm] = {"n": len(common), **{k: mean_std([by_seed[s][k] - runs[ref][s][k] for s in common])
                                          for k in keys}}
    return out


def _fmt(ms: tuple[float, float], digits: int = 3, sci: bool = False) -> str:
    m, sd = ms
    if math.isnan(m):
        return "-"
    f = (lambda v: f"{v:.2e}") if sci else (lambda v: f"{v:.{digits}f}")
    return f"{f(m)} ± {f(sd)}"


def markdown_table(table: dict, last_n: int, baseline: Optional[dict] = None) -> str:
    """The headline table (mean ± sample std over seeds) and the eval accuracy at every eval step."""
    lines = [f"| arm | seeds | held-out accuracy (final) | reward (last {last_n} steps) | mismatch/logp_abs_diff "
             "| trace code mismatch before | after | ais/alpha | is/truncated_frac | rollout tokens/s | train/step_s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in table.items():
        lines.append(f"| {arm} | {r['n']} | {_fmt(r['final_eval'])} | {_fmt(r['reward_last'])} | "
                     f"{_fmt(r['mismatch/logp_abs_diff'], sci=True)} | "
                     f"{_fmt(r['trace/code_mismatch_before'], sci=True)} | "
                     f"{_fmt(r['trace/code_mismatch_after'], sci=True)} | {_fmt(r['ais/alpha'], sci=True)} | "
                     f"{_fmt(r['is/truncated_frac'], sci=True)} | {_fmt(r['rollout/tokens_per_s'], 0)} | "
                     f"{_fmt(r['train/step_s'], 2)} |")
    steps = sorted(set().union(*(r["eval_steps"] for r in table.values()))) if table else []
    head = ["SFT start"] if baseline else []
    lines += ["", "| arm | " + " | ".join(head + [f"step {s}" for s in steps]) + " |",
              "|---|" + "---|" * (len(head) + len(steps))]
    for arm, r in table.items():
        start = [_fmt(baseline[arm])] if baseline else []
        lines.append(f"| {arm} | " + " | ".join(start + [_fmt(r["eval_steps"].get(s, (math.nan, math.nan)))
                                                            for s in steps]) + " |")
    return "\n".join(lines) + "\n"


def diffs_table(diffs: dict, ref: str, last_n: int) -> str:
    lines = [f"| arm - {ref} (paired per seed) | seeds | held-out accuracy | reward (last {last_n} steps) |",
             "|---|---|---|---|"]
    for arm, d in diffs.items():
        lines.append(f"| {arm} | {d['n']} | {_fmt(d['final_eval'])} | {_fmt(d['reward_last'])} |")
    return "\n".join(lines) + "\n"


def sft_baseline(root: Path, seeds: Sequence[int], arms: dict) -> Optional[dict]:
    """Held-out accuracy of the SFT checkpoints through each arm's engine (bf16 arm: BF16 engine)."""
    files = [sft_dir(root, s) / "sft_eval.json" for s in seeds]
    if not all(f.is_file() for f in files):
        return None
    evals = [json.loads(f.read_text()) for f in files]
    return {arm: mean_std([e["eval_accuracy_bf16" if "rollout.weights=bf16" in ov else "eval_accuracy_nvfp4"]
                           for e in evals]) for arm, ov in arms.items()}


def per_seed_table(runs: dict, root: Path, seeds: Sequence[int], arms: dict) -> str:
    """Final held-out accuracy of every run, with each seed's SFT start through the arm's engine."""
    lines = ["| arm | " + " | ".join(f"seed {s}: SFT start -> final" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for arm, by_seed in runs.items():
        cells = []
        for seed in seeds:
            f = sft_dir(root, seed) / "sft_eval.json"
            start = json.loads(f.read_text())["eval_accuracy_bf16" if "rollout.weights=bf16" in arms[arm]
                                              else "eval_accuracy_nvfp4"] if f.is_file() else math.nan
            final = by_seed[seed]["final_eval"] if seed in by_seed else math.nan
            cells.append(f"{start:.3f} -> {final:.3f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict, out_dir: Path, smooth: int = 5) -> list[Path]:
    """reward.png (training reward, moving mean over `smooth` steps), eval_accuracy.png and mismatch.png: per
    arm the mean over seeds with a ±1 std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, key, title, ylabel in (("reward", "reward", f"training reward (moving mean over {smooth} steps)",
                                      "reward/mean"),
                                     ("eval_accuracy", "eval", "held-out accuracy (greedy)", "accuracy"),
                                     ("mismatch", "mismatch", "|logp_train - logp_rollout| per token",
                                      "nats/token (log scale)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for arm, by_seed in runs.items():
            steps = sorted(set().union(*(s[key] for s in by_seed.values())))
            series = []
            for s in by_seed.values():
                vals = [s[key].get(st, math.nan) for st in steps]
                if key == "reward":
                    vals = _smooth(vals, smooth)
                series.append(vals)
            ms = [mean_std([v[i] for v in series]) for i in range(len(steps))]
            m = [x[0] for x in ms]
            sd = [x[1] for x in ms]
            (line,) = ax.plot(steps, m, label=f"{arm} (n={len(series)})", marker="o" if key == "eval" else None,
                              lw=1.3)
            ax.fill_between(steps, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                            color=line.get_color(), alpha=0.12)
        if key == "mismatch":
            ax.set_yscale("log")
        ax.set_title(f"{title}: mean ± std over seeds", fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def _smooth(vals: list, k: int) -> list:
    return [sum(w) / len(w) for w in (vals[max(0, i - k + 1):i + 1] for i in range(len(vals)))]


def plot_paired(runs: dict, ref: str, out_dir: Path, smooth: int = 5) -> Path:
    """paired_diff.png: per arm, (arm - ref) per seed on the same seed, mean ± std over seeds, for the
    held-out accuracy at each eval and the training reward (moving mean over `smooth` steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in ((axes[0], "eval", "held-out accuracy"),
                           (axes[1], "reward", f"training reward (moving mean over {smooth})")):
        for arm, by_seed in runs.items():
            if arm == ref:
                continue
            common = sorted(set(by_seed) & set(runs[ref]))
            steps = sorted(set().union(*(runs[ref][s][key] for s in common)))
            series = []
            for seed in common:
                d = [by_seed[seed][key].get(st, math.nan) - runs[ref][seed][key].get(st, math.nan) for st in steps]
                series.append(_smooth(d, smooth) if key == "reward" else d)
            ms = [mean_std([v[i] for v in series]) for i in range(len(steps))]
            m, sd = [x[0] for x in ms], [x[1] for x in ms]
            (line,) = ax.plot(steps, m, label=f"{arm} (n={len(series)})", marker="o" if key == "eval" else None,
                              lw=1.3)
            ax.fill_between(steps, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                            color=line.get_color(), alpha=0.12)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_title(f"{title}: arm - {ref}, same seed (mean ± std)", fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "paired_diff.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_outputs(root: Path, out_dir: Path, arms: dict, seeds: Sequence[int], last_n: int,
                  ref: str = "nvfp4") -> str:
    runs = collect(root, list(arms), seeds, last_n)
    table = aggregate(runs)
    baseline = sft_baseline(root, seeds, arms)
    md = markdown_table(table, last_n, baseline)
    if ref in runs:
        md += "\n" + diffs_table(paired_diffs(runs, ref), ref, last_n)
    md += "\n" + per_seed_table(runs, root, seeds, arms)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(md)
    _write_json(out_dir / "summary.json", {"runs": runs, "seeds": list(seeds), "last_n": last_n})
    if runs:
        plot_curves(runs, out_dir)
    if ref in runs and len(runs) > 1:
        plot_paired(runs, ref, out_dir)
    return md


# --------------------------------------------------------------------------------------------- CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tools/evidence.py", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["run", "aggregate", "sft", "init-hash", "check-init"])
    p.add_argument("--root", default=str(REPO / "runs/evidence"))
    p.add_argument("--out", default=str(REPO / "docs/figures/evidence"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=None, help="subset of configs/evidence/arms.yaml (default all)")
    p.add_argument("--arm", default=None)
    p.add_argument("--steps", type=int, default=None, help="override run.total_steps (default base.yaml)")
    p.add_argument("--last-n", type=int, default=10, help="reward is averaged over the last N steps")
    a = p.parse_args(argv)
    root, arms = Path(a.root), load_arms()
    chosen = {k: arms[k] for k in (a.arms or arms)}
    if a.command == "sft":
        job_sft(root, a.seed)
    elif a.command == "init-hash":
        job_init_hash(root, a.seed, a.arm)
    elif a.command == "check-init":
        print(json.dumps(check_init(root, a.seed, chosen), indent=1))
    elif a.command == "run":
        for seed in a.seeds:
            ensure_sft(root, seed)
            for arm in chosen:
                ensure_run(root, seed, arm, arms, a.steps)
        print(write_outputs(root, Path(a.out), chosen, a.seeds, a.last_n))
    else:
        print(write_outputs(root, Path(a.out), chosen, a.seeds, a.last_n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
