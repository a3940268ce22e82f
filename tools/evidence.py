"""The evidence campaign: FP4 RL arms x seeds on the tiny MoE, then one table and plots (docs/RESULTS.md).

    python tools/evidence.py run [--seeds 0 1 2] [--arms ...]   # SFT per seed, every arm, aggregate
    python tools/evidence.py aggregate                          # table + PNGs from finished runs only

H200 (tools/gpu_evidence.sh): `--base configs/evidence/h200_base.yaml --parallel 24 --gpus 0 1
--deadline-s 400 --smoke-steps 2 --sft-target 0.6` runs a 2-step smoke of two arms next to the seeds' SFT
(any smoke failure stops everything), then every arm of a seed as soon as its SFT is done, all at once, each
process on the GPU with the fewest running jobs (CUDA_VISIBLE_DEVICES) and killed at the deadline;
`aggregate --partial` then compares the runs over the steps all of them reached.

Layout under --root (default runs/evidence): `sft_seed{k}/` holds the seed's SFT warm start
(checkpoints/step_000000) and `sft_eval.json` (its held-out accuracy through the FP4 and the BF16 engine);
`seed{k}/{arm}/` is one RL run (metrics.jsonl, config.yaml, train.log, DONE). Every RL run starts from its
seed's SFT checkpoint with run.init_checkpoint and run.sft_steps=0, so the arms of one seed share their
starting weights exactly (`check-init` hashes them per arm, also after one zero-gradient optimizer step).
Runs go one at a time (or --parallel N at once), each in its own process; a finished run (DONE present) is
skipped, an unfinished one with a committed checkpoint resumes from it (`qrl train`'s resume; the metrics
stream keeps every step once), any other unfinished one starts again from scratch. A run stopped by its time
limit or a failure keeps its metrics and gets UNFINISHED instead of DONE. A seed whose records are there but
whose SFT checkpoint is not (a fresh machine) is redone whole when one of its arms still has to run.

The GPU-scale campaign (docs/RESULTS.md "FP4 RL arms at GPU scale (plan)", tools/gpu_evidence_h200.sh):
`--base configs/evidence/gpu_base.yaml --arms-file configs/evidence/gpu_arms.yaml`; its QeRL arm (lora.enabled)
starts from `sft_seed{k}/lora_checkpoints/step_000000`, which `sft` converts from the SFT weights. `--set
KEY=VALUE ...` adds overrides to every process; `--cpu` is the CPU smoke (fp32, 10 SFT steps, 2 RL steps).
`report` writes the campaign's tables with paired 95% intervals (tools/evidence_report.py), `archive` copies the
small records (metrics.jsonl, config.yaml, markers, sft_eval.json) for the repository.
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
BASE = REPO / "configs/evidence/base.yaml"   # --base replaces it (main() rebinds the module global)
ARMS = REPO / "configs/evidence/arms.yaml"   # --arms-file replaces it
SETS: list[str] = []                         # --set: dotted overrides for every process (e.g. the CPU smoke)
DONE = "DONE"
UNFINISHED = "UNFINISHED"                    # a run cut by its time limit or failed: metrics kept, marked

# table columns: (metric key, how a run's series is reduced, header)
RUN_MEANS = (("mismatch/logp_abs_diff", "mismatch/logp_abs_diff"),
             ("trace/code_mismatch_before", "trace code mismatch before"),
             ("trace/code_mismatch_after", "trace code mismatch after"),
             ("ais/alpha", "ais/alpha"),
             ("is/truncated_frac", "is/truncated_frac"),
             ("rollout/tokens_per_s", "rollout tokens/s"),
             ("train/step_s", "train/step_s"),
             ("step_wall_s", "RL step wall s"),   # time/wall differences (steps after an eval left out)
             ("policy/entropy", "policy entropy"),
             ("ais/alpha_ess", "ais/alpha_ess"), ("ais/alpha_mis", "ais/alpha_mis"),
             ("ais/alpha_var", "ais/alpha_var"),
             ("time/step_s", "RL step s"))
CURVES = {"mismatch": "mismatch/logp_abs_diff", "entropy": "policy/entropy"}   # per-step series kept per run


# ------------------------------------------------------------------------------------------ configs
def load_arms(path: Optional[Path] = None) -> dict[str, list[str]]:
    """The arms file (default: ARMS, which --arms-file rebinds): arm name -> dotted overrides."""
    path = path or ARMS
    arms = yaml.safe_load(Path(path).read_text())
    if not isinstance(arms, dict) or not all(isinstance(v, list) for v in arms.values()):
        raise ValueError(f"{path} must map each arm name to a list of dotted overrides")
    return arms


def seed_overrides(seed: int) -> list[str]:
    """Everything random follows the seed: data order and eval split, SFT init, sampling, AQN draws. The
    campaign's --set overrides follow (the arm's own overrides come last and win)."""
    return [f"run.seed={seed}", f"rollout.seed={seed}", f"data.seed={seed}", f"trainer.seed={1234 + seed}", *SETS]


def sft_dir(root: Path, seed: int) -> Path:
    return root / f"sft_seed{seed}"


def sft_checkpoint(root: Path, seed: int) -> Path:
    return sft_dir(root, seed) / "checkpoints/step_000000"


def lora_checkpoint(root: Path, seed: int) -> Path:
    """The QeRL arm's start: the seed's SFT weights packed as a frozen NVFP4 base, fresh adapters (B = 0)."""
    return sft_dir(root, seed) / "lora_checkpoints/step_000000"


def run_dir(root: Path, seed: int, arm: str) -> Path:
    return root / f"seed{seed}" / arm


def is_lora_arm(overrides: Sequence[str]) -> bool:
    return "lora.enabled=true" in overrides


def arm_overrides(root: Path, seed: int, arm: str, arms: dict, steps: Optional[int]) -> list[str]:
    extra = [f"run.total_steps={steps}"] if steps else []
    init = lora_checkpoint(root, seed) if is_lora_arm(arms[arm]) else sft_checkpoint(root, seed)
    return (seed_overrides(seed) + [f"run.output_dir={run_dir(root, seed, arm)}", "run.sft_steps=0",
                                    f"run.init_checkpoint={init}"] + extra + arms[arm])


_CUDA: Optional[bool] = None


def has_cuda() -> bool:
    """A GPU here? (QRL_EVIDENCE_CUDA=0/1 decides without importing torch.)"""
    global _CUDA
    if _CUDA is None:
        forced = os.environ.get("QRL_EVIDENCE_CUDA")
        if forced is not None:
            _CUDA = forced == "1"
        else:
            import torch

            _CUDA = torch.cuda.is_available()
    return _CUDA


def child_env(gpu: Optional[str] = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), WANDB_MODE="disabled",
               QRL_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    if not has_cuda():
        env.setdefault("TRITON_INTERPRET", "1")  # no GPU on the CPU campaign's box; megatron imports triton
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


# ---------------------------------------------------------------------------------- in-process jobs
def _setup(overrides: Sequence[str]):
    if not has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron_qrl.config import load_config
    from megatron_qrl.pipeline import RunSetup

    cfg = load_config(str(BASE), list(overrides))
    return cfg, RunSetup.build(cfg)


def weights_digest(trainer) -> str:
    """sha256 over the trainer's fp32 parameters, in name order (the RL run's starting point)."""
    from megatron_qrl.pipeline.sync import unwrap

    h = hashlib.sha256()
    for chunk in unwrap(trainer.model):
        for name, p in sorted(chunk.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class _Offset:
    """train_set[i + offset]: consecutive sft_warm_start calls continue where the previous one stopped."""

    def __init__(self, base, offset: int):
        self.base, self.offset = base, offset

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        return self.base[(i + self.offset) % len(self.base)]


def sft_until(s, max_steps: int, chunk: int, target: Optional[float], time_limit_s: Optional[float],
              probe_size: int = 64) -> list[dict]:
    """The SFT warm start in chunks of `chunk` steps (the same rows as one run of that many steps); after each
    chunk the greedy accuracy on `probe_size` TRAIN-split prompts (never the held-out set) through the run's
    engine. Stops at the first chunk whose probe accuracy reaches `target`, at `max_steps`, or once
    `time_limit_s` has passed. target None: one plain run of `max_steps` (the CPU campaign). Returns the log."""
    from megatron_qrl.pipeline import evaluate, sync_weights
    from megatron_qrl.pipeline.setup import sft_warm_start

    cfg = s.cfg
    if target is None:
        cfg.run.sft_steps = max_steps
        sft_warm_start(s)
        return [{"steps": max_steps}]
    base = s.train_set
    probe = [base[len(base) - 1 - i] for i in range(probe_size)]  # far past any SFT row index used here
    bs = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    log, done, t0 = [], 0, time.time()
    try:
        while done < max_steps:
            n = min(chunk, max_steps - done)
            s.train_set, cfg.run.sft_steps = _Offset(base, done * bs), n
            sft_warm_start(s)
            done += n
            engine = s.engine_ready()
            sync_weights(engine, s.trainer, cfg, step=0, version=done)
            ev = evaluate(engine, s.tokenizer, probe, cfg.rollout.max_new_tokens, s.reward_fn,
                          cfg.data.reward_time_limit_s)
            s.engine_idle()
            log.append({"steps": done, "loss": float(s.extra["sft/loss"]), "probe_accuracy": ev["eval/accuracy"],
                        "s": round(time.time() - t0, 1)})
            print("[sft]", json.dumps(log[-1]), flush=True)
            if ev["eval/accuracy"] >= target or (time_limit_s and time.time() - t0 >= time_limit_s):
                break
    finally:
        s.train_set, cfg.run.sft_steps = base, done
    return log


def job_sft(root: Path, seed: int, target: Optional[float] = None, chunk: int = 20,
            time_limit_s: Optional[float] = None) -> None:
    """SFT warm start once for the seed, saved as step 0; held-out accuracy through both engines. With
    `target`, the SFT stops early once the train-split probe accuracy reaches it (sft_until)."""
    from megatron_qrl.pipeline import evaluate, save_checkpoint, sync_weights
    from megatron_qrl.rollout.embedded import EmbeddedEngine

    out = sft_dir(root, seed)
    if out.exists():
        shutil.rmtree(out)
    cfg, s = _setup(seed_overrides(seed) + [f"run.output_dir={out}", "aqn.enabled=false", "run.sft_steps=0"])
    max_steps = load_config_steps()
    t0 = time.time()
    sft_log = sft_until(s, max_steps, chunk, target, time_limit_s)
    sft_s = time.time() - t0
    save_checkpoint(s, 0)
    result = {"seed": seed, "sft_steps": cfg.run.sft_steps, "sft_s": sft_s, "sft_loss": float(s.extra["sft/loss"]),
              "sft_target": target, "sft_log": sft_log, "weights_sha256": weights_digest(s.trainer)}
    bf16_cfg = cfg.model_copy(deep=True)
    bf16_cfg.rollout.weights, bf16_cfg.trace.enabled = "bf16", False
    bf16_cfg.rollout.kv_cache = "bf16"   # the BF16 reference engine is full precision throughout (its arm's KV too)
    for name, c, engine in (("nvfp4", cfg, s.engine_ready()), ("bf16", bf16_cfg, EmbeddedEngine(bf16_cfg))):
        sync_weights(engine, s.trainer, c, step=0, version=0)
        ev = evaluate(engine, s.tokenizer, s.eval_set, cfg.rollout.max_new_tokens, s.reward_fn,
                      cfg.data.reward_time_limit_s)
        result[f"eval_accuracy_{name}"] = ev["eval/accuracy"]
    lora_arms = [arm for arm, ov in load_arms().items() if is_lora_arm(ov)]
    if lora_arms:
        fresh = write_lora_start(root, seed, s, lora_arms[0])
        result["lora_start"] = {"checkpoint": str(lora_checkpoint(root, seed)), "fresh_adapter_tensors": len(fresh)}
    _write_json(out / "sft_eval.json", result)
    print(json.dumps(result))


def write_lora_start(root: Path, seed: int, s, arm: str) -> list[str]:
    """The QeRL arm's starting checkpoint: a LoRA trainer of that arm's config whose frozen NVFP4 base is packed
    from the SFT weights just saved (models/lora.py load_full_state), adapters at their seeded init."""
    from megatron_qrl.config import load_config
    from megatron_qrl.models.lora import load_full_state
    from megatron_qrl.pipeline.checkpoint_write import checkpoint_write
    from megatron_qrl.run_dir import mark_latest
    from megatron_qrl.trainer import Trainer

    overrides = [o for o in arm_overrides(root, seed, arm, load_arms(), None) if not o.startswith("run.init_")]
    lora = Trainer(load_config(str(BASE), overrides))
    missing = load_full_state(lora.unwrapped, s.trainer.unwrapped[0].state_dict())
    unexpected = [n for n in missing if n.rsplit(".", 1)[-1] not in ("lora_A", "lora_B")]
    if unexpected:
        raise SystemExit(f"QeRL start: the SFT checkpoint has nothing for {unexpected}")
    path = lora_checkpoint(root, seed)
    with checkpoint_write(path):
        lora.save(str(path), {"step": 0})
    mark_latest(path.parent.parent, path)
    return missing


def load_config_steps() -> int:
    """run.sft_steps of the base config with the campaign's --set overrides (the SFT's step budget)."""
    from megatron_qrl.config import load_config

    return int(load_config(str(BASE), list(SETS)).run.sft_steps)


def job_init_hash(root: Path, seed: int, arm: str) -> None:
    """The weights an arm's RL run starts from (same loading path as `qrl train`)."""
    from megatron_qrl.pipeline import resume_or_warm_start

    overrides = arm_overrides(root, seed, arm, load_arms(), None)
    overrides = [o for o in overrides if not o.startswith("run.output_dir=")]
    overrides.append(f"run.output_dir={root}/init_check/seed{seed}/{arm}")  # no checkpoint there: init path
    _, s = _setup(overrides)
    resume_or_warm_start(s)
    print("WEIGHTS", weights_digest(s.trainer))
    zero_grad_step(s.trainer)
    print("WEIGHTS_AFTER_STEP", weights_digest(s.trainer))


def zero_grad_step(trainer) -> None:
    """One optimizer step with all-zero gradients (Adam, no weight decay: no weight moves). The weights must
    stay as loaded; with bf16 on GPU they do not when the optimizer's fp32 master copy was never refreshed
    after a weights-only load (the H200 campaign's failure, docs/RESULTS.md)."""
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    trainer.optimizer.step()


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------- campaign
def _run_logged(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        return subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())


def sft_command(root: Path, seed: int, sft_opts: Sequence[str] = ()) -> list[str]:
    campaign = (["--arms-file", str(ARMS)] if Path(ARMS) != REPO / "configs/evidence/arms.yaml" else []) + \
        (["--set", *SETS] if SETS else [])
    return [sys.executable, str(Path(__file__).resolve()), "sft", "--root", str(root), "--seed", str(seed),
            "--base", str(BASE), *sft_opts, *campaign]


def run_command(root: Path, seed: int, arm: str, arms: dict, steps: Optional[int]) -> list[str]:
    return [sys.executable, "-m", "megatron_qrl.launch.train", "--config", str(BASE),
            *arm_overrides(root, seed, arm, arms, steps)]


def smoke_command(root: Path, arm: str, arms: dict, steps: int) -> list[str]:
    """A `steps`-step run of the arm from a 2-step SFT warm start (no checkpoint), with one eval at the end:
    every code path of the loop in seconds, before the campaign spends its time."""
    return [sys.executable, "-m", "megatron_qrl.launch.train", "--config", str(BASE), *seed_overrides(0),
            f"run.output_dir={root / 'smoke' / arm}", "run.sft_steps=2", f"run.total_steps={steps}",
            f"run.eval_every={steps}", "data.eval_size=16", *arms[arm]]


def sft_ready(root: Path, seed: int) -> bool:
    """The seed's SFT evaluated and its checkpoint committed (the records alone do not start a run)."""
    from megatron_qrl.run_dir import complete_checkpoints

    return (sft_dir(root, seed) / "sft_eval.json").is_file() and bool(complete_checkpoints(sft_dir(root, seed)))


def seed_done(root: Path, seed: int, arms: Sequence[str]) -> bool:
    return all((run_dir(root, seed, arm) / DONE).is_file() for arm in arms)


def redo_orphaned_seed(root: Path, seed: int, arms: Sequence[str]) -> None:
    """A seed's arms must share one SFT process's weights. Records without the SFT checkpoint (a fresh machine
    holding only the repository's runs/evidence_gpu) and an arm still to run: the seed is redone whole."""
    if seed_done(root, seed, arms) or sft_ready(root, seed) or not (sft_dir(root, seed) / "sft_eval.json").is_file():
        return
    print(f"[evidence] seed {seed}: records without its SFT checkpoint and unfinished arms: redone from a new SFT",
          flush=True)
    shutil.rmtree(sft_dir(root, seed))
    if (root / f"seed{seed}").exists():
        shutil.rmtree(root / f"seed{seed}")


def ensure_sft(root: Path, seed: int, sft_opts: Sequence[str] = ()) -> None:
    if sft_ready(root, seed):
        return
    log = root / f"logs/sft_seed{seed}.log"
    t0 = time.time()
    rc = _run_logged(sft_command(root, seed, sft_opts), log)
    if rc:
        raise SystemExit(f"SFT for seed {seed} failed (rc {rc}); see {log}")
    print(f"[evidence] sft seed {seed}: {time.time() - t0:.0f} s", flush=True)


def ensure_run(root: Path, seed: int, arm: str, arms: dict, steps: Optional[int]) -> None:
    out = run_dir(root, seed, arm)
    if (out / DONE).is_file():
        return
    prepare_for_restart(out)   # resumed from its last checkpoint, else started over
    cmd = run_command(root, seed, arm, arms, steps)
    t0 = time.time()
    rc = _run_logged(cmd, out / "train.log")
    wall = time.time() - t0
    if rc:
        raise SystemExit(f"run seed {seed} arm {arm} failed (rc {rc}); see {out / 'train.log'}")
    _write_json(out / DONE, {"wall_s": wall, "command": cmd})
    print(f"[evidence] seed {seed} {arm}: {wall:.0f} s", flush=True)


# -------------------------------------------------------------------------------- parallel campaign
class Job:
    """One child process of the parallel campaign: its command, log, and where its outcome is written."""

    def __init__(self, name: str, cmd: list[str], log: Path, kind: str, seed: Optional[int] = None,
                 out: Optional[Path] = None):
        self.name, self.cmd, self.log, self.kind, self.seed, self.out = name, cmd, log, kind, seed, out
        self.proc: Optional[subprocess.Popen] = None
        self.gpu: Optional[str] = None
        self.t0 = 0.0
        self.limit = math.inf
        self.rc: Optional[int] = None
        self.timed_out = False

    def start(self, gpu: Optional[str], limit_s: float) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.gpu, self.limit, self.t0 = gpu, limit_s, time.time()
        f = open(self.log, "a")   # a resumed run's log keeps what its earlier processes wrote
        f.write(f"# CUDA_VISIBLE_DEVICES={gpu} limit {limit_s:.0f} s\n" + " ".join(self.cmd) + "\n")
        f.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env(gpu),
                                     start_new_session=True)  # its own process group: a timeout kills it all
        f.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def poll(self, now: float) -> bool:
        """True once finished (exit, or killed at its limit)."""
        if self.proc is None or self.rc is not None:
            return self.rc is not None
        rc = self.proc.poll()
        if rc is None and now - self.t0 > self.limit:
            self.timed_out = True
            self.kill()
            rc = self.proc.returncode
        if rc is None:
            return False
        self.rc = rc
        return True

    @property
    def wall(self) -> float:
        return time.time() - self.t0


def resumable(out: Path) -> bool:
    """A run cut earlier (a deadline, a failure) with a committed checkpoint: `qrl train` resumes it from there,
    and its metrics stream continues with every step exactly once (docs/metrics.md "Resume")."""
    from megatron_qrl.run_dir import complete_checkpoints

    return not (out / DONE).is_file() and bool(complete_checkpoints(out))


def prepare_for_restart(out: Path) -> None:
    """Before a run's process starts: a resumable run keeps its directory (its UNFINISHED mark goes); any other
    unfinished one starts over from an empty directory."""
    if resumable(out):
        (out / UNFINISHED).unlink(missing_ok=True)
        return
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


def pick_gpu(gpus: Sequence[str], running: Sequence[Job]) -> Optional[str]:
    """The GPU with the fewest running jobs (ties: the first listed); None without GPUs."""
    if not gpus:
        return None
    load = {g: 0 for g in gpus}
    for j in running:
        if j.gpu in load:
            load[j.gpu] += 1
    return min(gpus, key=lambda g: load[g])


def log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [x for x in lines if "Warning" not in x and "warn(" not in x]
    tb = [i for i, x in enumerate(keep) if x.startswith("Traceback")]
    return "\n".join(keep[tb[0]:tb[0] + n] if tb else keep[-n:])


def run_parallel(root: Path, seeds: Sequence[int], arms: dict, chosen: Sequence[str], steps: Optional[int],
                 parallel: int, gpus: Sequence[str], deadline_s: Optional[float], run_limit_s: Optional[float],
                 sft_opts: Sequence[str] = (), smoke_arms: Sequence[str] = (), smoke_steps: int = 0,
                 poll_s: float = 1.0, min_start_s: float = 20.0) -> dict:
    """SFT of every seed (and a smoke run of `smoke_arms`) at once, then every arm of a seed as soon as its SFT
    is done; at most `parallel` processes, each on the least-loaded GPU, each killed at min(run_limit_s, the
    campaign deadline); one that would get less than `min_start_s` is not started. A failed smoke stops everything (returns with 'smoke_failed'); a failed SFT drops its
    seed; a run that fails or is cut gets UNFINISHED (its metrics stay for `aggregate --partial`)."""
    t_start = time.time()
    end = t_start + deadline_s if deadline_s else math.inf
    queue: list[Job] = []
    for arm in smoke_arms if smoke_steps else ():
        out = root / "smoke" / arm
        if out.exists():
            shutil.rmtree(out)
        queue.append(Job(f"smoke {arm}", smoke_command(root, arm, arms, smoke_steps), root / f"logs/smoke_{arm}.log",
                         "smoke", out=out))
    for seed in seeds:
        redo_orphaned_seed(root, seed, chosen)
        if not sft_ready(root, seed) and not seed_done(root, seed, chosen):
            queue.append(Job(f"sft seed {seed}", sft_command(root, seed, sft_opts), root / f"logs/sft_seed{seed}.log",
                             "sft", seed))
    sft_ok = {seed for seed in seeds if sft_ready(root, seed)}
    waiting = {seed: [arm for arm in chosen if not (run_dir(root, seed, arm) / DONE).is_file()] for seed in seeds}
    running: list[Job] = []
    summary: dict = {"jobs": [], "smoke_failed": False}

    def release(seed: int) -> None:
        for arm in waiting.pop(seed, []):
            out = run_dir(root, seed, arm)
            prepare_for_restart(out)
            queue.append(Job(f"seed {seed} {arm}", run_command(root, seed, arm, arms, steps), out / "train.log",
                             "run", seed, out))

    for seed in sorted(sft_ok):
        release(seed)
    import signal

    def stop(signum, _frame):  # children run in sessions of their own: take them down with us
        raise SystemExit(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        _schedule(root, queue, running, waiting, release, summary, parallel, gpus, run_limit_s, end, t_start,
                  poll_s, min_start_s)
    finally:
        for job in running:
            job.kill()
        signal.signal(signal.SIGTERM, old)
    summary["wall_s"] = time.time() - t_start
    _write_json(root / "campaign.json", summary)
    return summary


def _schedule(root, queue, running, waiting, release, summary, parallel, gpus, run_limit_s, end, t_start,
              poll_s, min_start_s) -> None:
    while queue or running:
        now = time.time()
        while queue and len(running) < parallel:
            job = queue.pop(0)
            limit = min(run_limit_s or math.inf, end - now)
            if limit < min_start_s:
                summary["jobs"].append({"name": job.name, "rc": None, "not_started": True})
                if job.kind == "run":
                    _write_json(job.out / UNFINISHED, {"reason": "not started before the deadline"})
                continue
            job.start(pick_gpu(gpus, running), limit)
            running.append(job)
            print(f"[evidence] {time.time() - t_start:6.0f} s start {job.name} on GPU {job.gpu} "
                  f"(limit {limit:.0f} s)", flush=True)
        time.sleep(poll_s)
        for job in [j for j in running if j.poll(time.time())]:
            running.remove(job)
            rec = {"name": job.name, "rc": job.rc, "timed_out": job.timed_out, "wall_s": round(job.wall, 1),
                   "gpu": job.gpu}
            summary["jobs"].append(rec)
            print(f"[evidence] {time.time() - t_start:6.0f} s {job.name}: rc {job.rc}"
                  f"{' (time limit)' if job.timed_out else ''}, {job.wall:.0f} s", flush=True)
            if job.kind == "smoke" and job.rc != 0:
                print(f"[evidence] SMOKE FAILED: {job.name}; see {job.log}\n{log_tail(job.log)}", flush=True)
                summary["smoke_failed"] = True
                return
            if job.kind == "sft":
                if job.rc == 0 and (sft_dir(root, job.seed) / "sft_eval.json").is_file():
                    release(job.seed)
                else:
                    print(f"[evidence] SFT seed {job.seed} failed; its arms are skipped\n{log_tail(job.log)}",
                          flush=True)
                    waiting.pop(job.seed, None)
            elif job.kind == "run":
                info = {"wall_s": job.wall, "command": job.cmd, "gpu": job.gpu, "rc": job.rc}
                if job.rc == 0 and not job.timed_out:
                    _write_json(job.out / DONE, info)
                else:
                    info["reason"] = "time limit" if job.timed_out else f"exit code {job.rc}"
                    _write_json(job.out / UNFINISHED, info)
                    if not job.timed_out:
                        print(log_tail(job.log, 20), flush=True)


def check_init(root: Path, seed: int, arms: Iterable[str]) -> dict:
    """Hash each arm's starting weights in its own process, as loaded and after one zero-gradient optimizer step;
    all must equal the SFT checkpoint's."""
    result = {"seed": seed, "sft": json.loads((sft_dir(root, seed) / "sft_eval.json").read_text())["weights_sha256"]}
    for arm in arms:
        proc = subprocess.run([sys.executable, __file__, "init-hash", "--root", str(root), "--seed", str(seed),
                               "--arm", arm, "--base", str(BASE)], cwd=REPO, env=child_env(), capture_output=True,
                              text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("WEIGHTS ")]
        after = [x for x in proc.stdout.splitlines() if x.startswith("WEIGHTS_AFTER_STEP ")]
        if proc.returncode or not line or not after:
            raise SystemExit(f"init-hash {arm} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        result[arm] = line[-1].split()[1]
        result[f"{arm} after a zero-gradient step"] = after[-1].split()[1]
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


def step_walls(records: list[dict]) -> list[float]:
    """Wall seconds of each RL step (time/wall differences), leaving out the steps after an eval step (their
    difference includes the eval)."""
    out, prev = [], None
    for r in sorted(records, key=lambda r: r["step"]):
        t = r.get("time/wall")
        if prev is not None and finite([t, prev[1]]) and r["step"] == prev[0] + 1 and not prev[2]:
            out.append(float(t) - float(prev[1]))
        prev = (r["step"], t, bool(finite([r.get("eval/accuracy")])))
    return out


def summarize_run(records: list[dict], last_n: int, upto: Optional[int] = None) -> dict:
    """One run's numbers: eval accuracy per eval step and at the last one, reward over the last N steps,
    means over all steps of the mismatch/TRACE/throughput metrics (NaN where the run never logged them).
    upto: only steps <= upto count (runs cut at different steps are compared over the steps all reached)."""
    records = sorted(records, key=lambda r: r["step"])
    last_step = int(records[-1]["step"]) if records else -1
    if upto is not None:
        records = [r for r in records if r["step"] <= upto]
    evals = {int(r["step"]): float(r["eval/accuracy"]) for r in records if finite([r.get("eval/accuracy")])}
    rewards = finite(r.get("reward/mean") for r in records)
    out = {"steps": len(records), "last_step": last_step, "eval": evals,
           "final_eval": evals[max(evals)] if evals else math.nan,
           "reward_last": sum(rewards[-last_n:]) / len(rewards[-last_n:]) if rewards else math.nan,
           "reward": {int(r["step"]): float(r["reward/mean"]) for r in records if finite([r.get("reward/mean")])},
           **{name: {int(r["step"]): float(r[key]) for r in records if finite([r.get(key)])}
              for name, key in CURVES.items()}}
    for key, _ in RUN_MEANS:
        vals = step_walls(records) if key == "step_wall_s" else finite(r.get(key) for r in records)
        out[key] = sum(vals) / len(vals) if vals else math.nan
    return out


def collect(root: Path, arms: Sequence[str], seeds: Sequence[int], last_n: int, partial: bool = False,
            min_steps: int = 1) -> dict:
    """{arm: {seed: summary}} over finished runs (DONE present). partial: also runs marked UNFINISHED (cut by
    their time limit) that logged at least `min_steps` steps, every run then truncated to the steps all of
    them reached (the horizon, `summary['upto']`); each summary says whether its run finished."""
    found = []
    for arm in arms:
        for seed in seeds:
            d = run_dir(root, seed, arm)
            done = (d / DONE).is_file()
            if not (done or (partial and (d / "metrics.jsonl").is_file())):
                continue
            recs = read_records(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
            if not done and len(recs) < min_steps:
                continue
            found.append((arm, seed, done, recs))
    upto = None
    if partial and found:
        upto = min(max((int(r["step"]) for r in recs), default=-1) for _, _, _, recs in found)
    out: dict = {}
    for arm, seed, done, recs in found:
        summary = summarize_run(recs, last_n, upto)
        summary.update(finished=done, upto=upto)
        out.setdefault(arm, {})[seed] = summary
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


STEP_KEYS = ("reward/mean", "response/len_mean", "mismatch/logp_abs_diff", "trace/code_mismatch_before",
             "trace/code_mismatch_after", "is/rho_min", "is/rho_max", "r3/router_agreement", "ais/alpha",
             "rollout/tokens_per_s", "sync/s", "train/step_s")


def step_table(root: Path, arms: Sequence[str], seeds: Sequence[int], step: int,
               keys: Sequence[str] = STEP_KEYS) -> str:
    """One RL step's metrics per arm, mean ± std over the seeds that logged it (finished or not): e.g. step 0,
    the only step whose rollouts come from the SFT weights in every arm."""
    lines = [f"| arm (step {step}) | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for arm in arms:
        rows = []
        for seed in seeds:
            f = run_dir(root, seed, arm) / "metrics.jsonl"
            if f.is_file():
                rows += [r for r in read_records(f) if r["step"] == step]
        if rows:
            cells = [_fmt(mean_std([r.get(k) for r in rows]), sci=abs(mean_std([r.get(k) for r in rows])[0]) < 1e-2)
                     for k in keys]
            lines.append(f"| {arm} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(ms: tuple[float, float], digits: int = 3, sci: bool = False) -> str:
    m, sd = ms
    if math.isnan(m):
        return "-"
    f = (lambda v: f"{v:.2e}") if sci else (lambda v: f"{v:.{digits}f}")
    return f"{f(m)} ± {f(sd)}"


def markdown_table(table: dict, last_n: int, baseline: Optional[dict] = None) -> str:
    """The headline table (mean ± sample std over seeds) and the eval accuracy at every eval step."""
    lines = [f"| arm | seeds | held-out accuracy (final) | reward (last {last_n} steps) | mismatch/logp_abs_diff "
             "| trace code mismatch before | after | ais/alpha | is/truncated_frac | rollout tokens/s | train/step_s "
             "| RL step wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in table.items():
        lines.append(f"| {arm} | {r['n']} | {_fmt(r['final_eval'])} | {_fmt(r['reward_last'])} | "
                     f"{_fmt(r['mismatch/logp_abs_diff'], sci=True)} | "
                     f"{_fmt(r['trace/code_mismatch_before'], sci=True)} | "
                     f"{_fmt(r['trace/code_mismatch_after'], sci=True)} | {_fmt(r['ais/alpha'], sci=True)} | "
                     f"{_fmt(r['is/truncated_frac'], sci=True)} | {_fmt(r['rollout/tokens_per_s'], 0)} | "
                     f"{_fmt(r['train/step_s'], 2)} | {_fmt(r['step_wall_s'], 2)} |")
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
            cut = "" if seed not in by_seed or by_seed[seed].get("finished", True) else \
                f" (cut after step {by_seed[seed]['last_step']})"
            cells.append(f"{start:.3f} -> {final:.3f}{cut}")
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
        if key == "mismatch" and any(v > 0 for by_seed in runs.values() for x in by_seed.values()
                                     for v in x["mismatch"].values()):
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
                  ref: str = "nvfp4", partial: bool = False, min_steps: int = 1) -> str:
    runs = collect(root, list(arms), seeds, last_n, partial, min_steps)
    table = aggregate(runs)
    baseline = sft_baseline(root, seeds, arms)
    md = ""
    upto = next((s["upto"] for by_seed in runs.values() for s in by_seed.values()), None)
    if partial:
        cut = sorted(f"seed {seed} {arm} (last step {s['last_step']})" for arm, by_seed in runs.items()
                     for seed, s in by_seed.items() if not s["finished"])
        missing = sorted(f"seed {seed} {arm}" for arm in arms for seed in seeds if seed not in runs.get(arm, {}))
        md += (f"Runs compared over steps 0..{upto} (the last step every included run logged). "
               f"Cut by the time limit: {', '.join(cut) or 'none'}. Left out (no run or < {min_steps} steps): "
               f"{', '.join(missing) or 'none'}.\n\n")
    md += markdown_table(table, last_n, baseline)
    if ref in runs:
        md += "\n" + diffs_table(paired_diffs(runs, ref), ref, last_n)
    md += "\n" + per_seed_table(runs, root, seeds, arms)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(md)
    _write_json(out_dir / "summary.json", {"runs": runs, "seeds": list(seeds), "last_n": last_n, "upto": upto})
    if runs:
        plot_curves(runs, out_dir)
    if ref in runs and len(runs) > 1:
        plot_paired(runs, ref, out_dir)
    return md


# --------------------------------------------------------------------------------------------- CLI
# --cpu: every arm for 2 RL steps from a 10-step SFT on the CPU, through the same commands as the GPU campaign
CPU_FP32 = ("trainer.bf16=false", "trainer.use_distributed_optimizer=false")   # a GPU config on the CPU
CPU_SMOKE = CPU_FP32 + ("run.sft_steps=10", "run.total_steps=2", "run.eval_every=2", "data.eval_size=16",
                        "run.checkpoint_every=1")


def main(argv: Optional[Sequence[str]] = None) -> int:
    global BASE, ARMS, SETS, _CUDA
    p = argparse.ArgumentParser(prog="tools/evidence.py", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["run", "aggregate", "sft", "init-hash", "check-init", "step-table", "report",
                                       "archive"])
    p.add_argument("--root", default=str(REPO / "runs/evidence"))
    p.add_argument("--out", default=str(REPO / "docs/figures/evidence"))
    p.add_argument("--base", default=str(BASE), help="the shared config (default configs/evidence/base.yaml)")
    p.add_argument("--arms-file", default=str(ARMS), help="the arms (default configs/evidence/arms.yaml)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="dotted overrides for every process of the campaign (SFT, runs, smoke), before the arm's")
    p.add_argument("--cpu", action="store_true", help="CPU smoke: no GPU, " + " ".join(CPU_SMOKE))
    p.add_argument("--dest", default=str(REPO / "runs/evidence_gpu"), help="archive: where the records go")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=None, help="subset of configs/evidence/arms.yaml (default all)")
    p.add_argument("--arm", default=None)
    p.add_argument("--steps", type=int, default=None, help="override run.total_steps (default base.yaml)")
    p.add_argument("--last-n", type=int, default=10, help="reward is averaged over the last N steps")
    p.add_argument("--step", type=int, default=0, help="step-table: the RL step to tabulate")
    g = p.add_argument_group("SFT warm start (sft, run)")
    g.add_argument("--sft-target", type=float, default=None,
                   help="stop the SFT once greedy accuracy on 64 train-split prompts reaches this (checked every "
                        "--sft-chunk steps; run.sft_steps is the upper bound). Default: plain run.sft_steps")
    g.add_argument("--sft-chunk", type=int, default=20)
    g.add_argument("--sft-time", type=float, default=None, help="stop the SFT after the chunk that passes this "
                                                               "many seconds")
    g = p.add_argument_group("parallel campaign (run)")
    g.add_argument("--parallel", type=int, default=0, help="processes at once (0: one at a time, CPU campaign)")
    g.add_argument("--gpus", nargs="*", default=[], help="CUDA_VISIBLE_DEVICES values to spread processes over")
    g.add_argument("--deadline-s", type=float, default=None, help="every process is killed this many seconds "
                                                                  "after the campaign starts")
    g.add_argument("--run-limit-s", type=float, default=None, help="time limit of one process")
    g.add_argument("--smoke-steps", type=int, default=0, help="first: a run of this many steps of --smoke-arms "
                                                              "next to the SFTs; a failure stops everything")
    g.add_argument("--smoke-arms", nargs="+", default=["nvfp4_trace_ais_aqn", "bf16"])
    g = p.add_argument_group("aggregation (run, aggregate)")
    g.add_argument("--partial", action="store_true", help="include runs cut by their time limit; compare all "
                                                          "runs over the steps every one of them reached")
    g.add_argument("--min-steps", type=int, default=5, help="with --partial: leave out runs with fewer steps")
    a = p.parse_args(argv)
    BASE, ARMS = Path(a.base).resolve(), Path(a.arms_file).resolve()
    SETS = [*(CPU_SMOKE if a.cpu else ()), *a.set]
    if a.cpu:
        os.environ["QRL_EVIDENCE_CUDA"] = "0"   # children too
        _CUDA = False
    root, arms = Path(a.root), load_arms(ARMS)
    chosen = {k: arms[k] for k in (a.arms or arms)}
    sft_opts = [o for flag, v in (("--sft-target", a.sft_target), ("--sft-chunk", a.sft_chunk),
                                  ("--sft-time", a.sft_time)) if v is not None for o in (flag, str(v))]
    if a.command == "sft":
        job_sft(root, a.seed, a.sft_target, a.sft_chunk, a.sft_time)
    elif a.command == "init-hash":
        job_init_hash(root, a.seed, a.arm)
    elif a.command == "check-init":
        print(json.dumps(check_init(root, a.seed, chosen), indent=1))
    elif a.command == "step-table":
        md = step_table(root, list(chosen), a.seeds, a.step)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"step{a.step}.md").write_text(md)
        print(md)
    elif a.command == "run" and a.parallel:
        summary = run_parallel(root, a.seeds, arms, list(chosen), a.steps, a.parallel, a.gpus, a.deadline_s,
                               a.run_limit_s, sft_opts, a.smoke_arms, a.smoke_steps)
        if summary["smoke_failed"]:
            return 3
        print(write_outputs(root, Path(a.out), chosen, a.seeds, a.last_n, partial=a.partial,
                            min_steps=a.min_steps))
    elif a.command == "report":
        import evidence_report

        print(evidence_report.write_report(root, Path(a.out), chosen, a.seeds, a.last_n, a.partial, a.min_steps))
    elif a.command == "archive":
        import evidence_report

        files = evidence_report.archive(root, Path(a.dest), list(chosen), a.seeds)
        print(f"{len(files)} files, {sum(f.stat().st_size for f in files)} bytes -> {a.dest}")
    elif a.command == "run":
        for seed in a.seeds:
            redo_orphaned_seed(root, seed, list(chosen))
            if not seed_done(root, seed, list(chosen)):
                ensure_sft(root, seed, sft_opts)
            for arm in chosen:
                ensure_run(root, seed, arm, arms, a.steps)
        print(write_outputs(root, Path(a.out), chosen, a.seeds, a.last_n))
    else:
        print(write_outputs(root, Path(a.out), chosen, a.seeds, a.last_n, partial=a.partial,
                            min_steps=a.min_steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
