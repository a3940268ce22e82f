"""The GPU-scale evidence report (docs/RESULTS.md "FP4 RL arms at GPU scale"): per-arm finals and curves,
paired per-seed differences against two references (bf16 and nvfp4) with 95% t-intervals, the mechanism
columns (mismatch, TRACE codes, AIS alpha and its factors, policy entropy, throughput), PNG plots, and the
raw per-run records copied into the repository (small files only, never checkpoints).

    python tools/evidence.py report --root R --out DIR --arms-file configs/evidence/gpu_arms.yaml [--partial]
    python tools/evidence.py archive --root R --dest runs/evidence_gpu
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Optional, Sequence

import evidence as ev
from evidence_stats import fmt_ci, mean_ci, paired_ci

REFS = ("bf16", "nvfp4")
# (summary key, header, scientific notation): per-run means over the compared steps, mean ± sd over seeds
MECHANISM = (("policy/entropy", "policy entropy", False), ("mismatch/logp_abs_diff", "mismatch/logp_abs_diff", True),
             ("trace/code_mismatch_before", "code mismatch before", True),
             ("trace/code_mismatch_after", "after", True), ("ais/alpha", "ais/alpha", True),
             ("ais/alpha_ess", "alpha_ess", False), ("ais/alpha_mis", "alpha_mis", True),
             ("ais/alpha_var", "alpha_var", True), ("rollout/tokens_per_s", "rollout tokens/s", False),
             ("train/step_s", "train/step_s", False), ("time/step_s", "RL step s", False))
PAIRED = (("final_eval", "held-out accuracy (final)"), ("gain", "gain over the SFT start"),
          ("reward_last", "reward (last N)"), ("policy/entropy", "policy entropy"))


def sft_start(root: Path, seed: int, overrides: Sequence[str]) -> float:
    """Held-out accuracy of the seed's SFT checkpoint through the arm's engine (bf16 arm: the BF16 engine)."""
    f = ev.sft_dir(root, seed) / "sft_eval.json"
    if not f.is_file():
        return math.nan
    e = json.loads(f.read_text())
    return e["eval_accuracy_bf16" if "rollout.weights=bf16" in overrides else "eval_accuracy_nvfp4"]


def with_gains(runs: dict, root: Path, arms: dict) -> dict:
    """Adds per run 'start' (SFT accuracy through its engine) and 'gain' = final - start."""
    for arm, by_seed in runs.items():
        for seed, r in by_seed.items():
            r["start"] = sft_start(root, seed, arms[arm])
            r["gain"] = r["final_eval"] - r["start"]
    return runs


def _ms(values, sci: bool = False, digits: int = 3) -> str:
    ms = ev.mean_std(values)
    return ev._fmt(ms, digits, sci=sci)


def headline_table(runs: dict, last_n: int) -> str:
    lines = [f"| arm | seeds | SFT start | held-out accuracy (final) | gain over start, 95% CI | reward (last {last_n}) "
             "| last step |", "|---|---|---|---|---|---|---|"]
    for arm, by_seed in runs.items():
        r = list(by_seed.values())
        lines.append(f"| {arm} | {len(r)} | {_ms([x['start'] for x in r])} | {_ms([x['final_eval'] for x in r])} | "
                     f"{fmt_ci(mean_ci([x['gain'] for x in r]))} | {_ms([x['reward_last'] for x in r])} | "
                     f"{', '.join(str(x['last_step']) for x in r)} |")
    return "\n".join(lines) + "\n"


def mechanism_table(runs: dict) -> str:
    lines = ["| arm | " + " | ".join(h for _, h, _ in MECHANISM) + " |", "|---|" + "---|" * len(MECHANISM)]
    for arm, by_seed in runs.items():
        r = list(by_seed.values())
        cells = [_ms([x[k] for x in r], sci=sci, digits=3 if k != "rollout/tokens_per_s" else 0)
                 for k, _, sci in MECHANISM]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_tables(runs: dict, refs: Sequence[str] = REFS) -> tuple[str, dict]:
    """One table per reference: arm - ref per seed, mean [95% t-interval], for each PAIRED quantity."""
    md, out = "", {}
    for ref in refs:
        if ref not in runs:
            continue
        lines = [f"| arm - {ref} (paired per seed) | seeds | " + " | ".join(h for _, h in PAIRED) + " |",
                 "|---|---|" + "---|" * len(PAIRED)]
        out[ref] = {}
        for arm, by_seed in runs.items():
            if arm == ref:
                continue
            cis = {k: paired_ci({s: r[k] for s, r in by_seed.items()}, {s: r[k] for s, r in runs[ref].items()})
                   for k, _ in PAIRED}
            out[ref][arm] = cis
            n = cis["final_eval"]["n"]
            lines.append(f"| {arm} | {n} | " + " | ".join(fmt_ci(cis[k], 4 if k == "policy/entropy" else 3)
                                                          for k, _ in PAIRED) + " |")
        md += "\n".join(lines) + "\n\n"
    return md, out


def eval_curve_table(runs: dict) -> str:
    steps = sorted(set().union(*(r["eval"] for by_seed in runs.values() for r in by_seed.values()))) if runs else []
    lines = ["| arm | SFT start | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|---|" + "---|" * len(steps)]
    for arm, by_seed in runs.items():
        r = list(by_seed.values())
        lines.append(f"| {arm} | {_ms([x['start'] for x in r])} | " +
                     " | ".join(_ms([x["eval"].get(s, math.nan) for x in r]) for s in steps) + " |")
    return "\n".join(lines) + "\n"


def plot_entropy(runs: dict, out_dir: Path) -> Path:
    """entropy.png: policy/entropy per RL step, mean over seeds with a ±1 std band, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, by_seed in runs.items():
        steps = sorted(set().union(*(r["entropy"] for r in by_seed.values())))
        if not steps:
            continue
        ms = [ev.mean_std([r["entropy"].get(st, math.nan) for r in by_seed.values()]) for st in steps]
        m, sd = [x[0] for x in ms], [x[1] for x in ms]
        (line,) = ax.plot(steps, ev._smooth(m, 5), label=f"{arm} (n={len(by_seed)})", lw=1.3)
        ax.fill_between(steps, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                        color=line.get_color(), alpha=0.10)
    ax.set_title("policy entropy on the rollout tokens (moving mean over 5 steps; band: ±1 std over seeds)",
                 fontsize=9)
    ax.set_xlabel("RL step")
    ax.set_ylabel("nats/token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / "entropy.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_report(root: Path, out_dir: Path, arms: dict, seeds: Sequence[int], last_n: int, partial: bool,
                 min_steps: int = 1) -> str:
    """table.md, summary.json and the PNGs under out_dir; returns the markdown."""
    runs = with_gains(ev.collect(root, list(arms), seeds, last_n, partial, min_steps), root, arms)
    upto = next((r["upto"] for by_seed in runs.values() for r in by_seed.values()), None)
    md = ""
    if partial:
        cut = sorted(f"seed {s} {a} (last step {r['last_step']})" for a, by_seed in runs.items()
                     for s, r in by_seed.items() if not r["finished"])
        missing = sorted(f"seed {s} {a}" for a in arms for s in seeds if s not in runs.get(a, {}))
        md += (f"Compared over steps 0..{upto} (the last step every included run logged). Unfinished: "
               f"{', '.join(cut) or 'none'}. Left out (no run or < {min_steps} steps): {', '.join(missing) or 'none'}.\n\n")
    paired_md, paired = paired_tables(runs)
    md += headline_table(runs, last_n) + "\n" + paired_md + mechanism_table(runs) + "\n" + eval_curve_table(runs)
    md += "\n" + ev.per_seed_table(runs, root, seeds, arms)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(md)
    ev._write_json(out_dir / "summary.json", {"runs": runs, "paired": paired, "seeds": list(seeds), "upto": upto,
                                              "last_n": last_n})
    if runs:
        ev.plot_curves(runs, out_dir)
        plot_entropy(runs, out_dir)
        for ref in REFS:
            if ref in runs and len(runs) > 1:
                ev.plot_paired(runs, ref, out_dir).rename(out_dir / f"paired_vs_{ref}.png")
    return md


# files of a run directory worth keeping in the repository (small); checkpoints and logs stay behind
RUN_FILES = ("metrics.jsonl", "config.yaml", ev.DONE, ev.UNFINISHED)


def archive(root: Path, dest: Path, arms: Sequence[str], seeds: Sequence[int],
            max_bytes: int = 2_000_000) -> list[Path]:
    """Copies every run's RUN_FILES, every seed's sft_eval.json and campaign.json from root to dest."""
    copied = []
    pairs = [(ev.sft_dir(root, s) / "sft_eval.json", ev.sft_dir(dest, s) / "sft_eval.json") for s in seeds]
    pairs += [(ev.run_dir(root, s, a) / f, ev.run_dir(dest, s, a) / f) for s in seeds for a in arms for f in RUN_FILES]
    pairs.append((root / "campaign.json", dest / "campaign.json"))
    for src, dst in pairs:
        if not src.is_file():
            continue
        if src.stat().st_size > max_bytes:
            raise SystemExit(f"{src} is {src.stat().st_size} bytes (> {max_bytes}): not a small record; check it")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        copied.append(dst)
    return copied
