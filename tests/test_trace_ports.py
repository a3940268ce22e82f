"""TRACE's two ports: the engine's TraceRecorder (records under sample handles, sealed caches of a batch) and the
trainer's TraceReplay (measures only its first pass, reports the delivery, refuses stale caches), and the one
transport between them in a colocated multi-rank run with dynamic sampling (handles != batch positions)."""
from pathlib import Path

import pytest
import torch

from megatron_qrl.config import load_config
from megatron_qrl.rollout.protocol import RolloutSample
from megatron_qrl.trace import TraceCacheBuilder, TraceMetrics, TraceRecorder, TraceReplay, config_fingerprint
from megatron_qrl.trace.synthetic import make_rollout
from megatron_qrl.trainer.batch import BatchError, validate

ROOT = Path(__file__).resolve().parents[1]


def _cfg():
    return load_config(ROOT / "configs/tiny_cpu.yaml", [])


def _samples(ro):
    return [RolloutSample(prompt_ids=[1] * ro.prompt_len, tokens=[2] * (ro.seq_len - ro.prompt_len + 1), logprobs=None,
                          finish_reason="stop", routed_experts=ro.routed[s], trace=ro.captures[s])
            for s in range(ro.num_samples)]


def test_recorder_seals_the_batch_in_its_order_and_forgets_after():
    cfg = _cfg()
    ro = make_rollout(num_samples=6, seq_len=10, prompt_len=4)
    rec = TraceRecorder(cfg, torch.nn.Linear(2, 2), cfg.cached_layers())
    rec.reset(version=3)
    samples = rec.keep(_samples(ro), first_index=10)            # a second generate call of the step: 10..15
    assert [s.trace_handle for s in samples] == list(range(10, 16)) and len(rec) == 6
    handles = [14, 99, 10, 12]                                  # 99: another engine's sample
    cache = rec.seal(handles, step=7)
    expect = TraceCacheBuilder(3, 7, config_fingerprint(cfg), layers=cfg.cached_layers())
    for position, s in ((0, 4), (2, 0), (3, 2)):
        expect.add_sample(position, ro.captures[s], routed_experts=ro.routed[s])
    assert cache.same_content(expect.build()) and (cache.weight_version, cache.step) == (3, 7)
    assert len(rec) == 0                                        # sealed once: the records are gone
    rec.keep(_samples(ro), first_index=0)
    rec.reset(version=4)                                        # new weights: old records never reach a cache
    assert len(rec) == 0 and rec.seal(range(6), step=8).n_tokens == 0


def test_recorder_of_an_engine_without_trace_keeps_handles_only():
    cfg = _cfg()
    rec = TraceRecorder(cfg, torch.nn.Linear(2, 2), [])
    samples = rec.keep(_samples(make_rollout(num_samples=2)), first_index=5)
    assert [s.trace_handle for s in samples] == [5, 6] and len(rec) == 0 and not rec.enabled


class _Hook:
    def __init__(self):
        self.measuring, self.prepared, self.calls = False, None, []

    def prepare(self, micro_batches):
        self.prepared = micro_batches

    def __call__(self, sample_ids, batch_rows):
        self.calls.append((sample_ids, batch_rows, self.measuring))
        return "provider"


def test_replay_measures_only_the_first_pass_after_a_load():
    hook = _Hook()
    metrics = TraceMetrics()
    metrics.count("guided_rows", 5)
    replay = TraceReplay(_cfg())
    assert replay.metrics() == {} and replay.for_micro_batch([0], [0]) is None   # nothing loaded: nearest
    replay.install(hook, metrics, {"trace/transfer_s": 0.5, "trace/cache_bytes": 9.0})
    replay.begin_pass([("ids", "rows")])
    assert hook.prepared == [("ids", "rows")] and replay.for_micro_batch("ids", "rows") == "provider"
    replay.end_pass()
    replay.begin_pass([("ids", "rows")])
    replay.for_micro_batch("ids", "rows")
    assert [m for _, _, m in hook.calls] == [True, False]
    m = replay.metrics()
    assert m["trace/guided_rows"] == 5 and m["trace/transfer_s"] == 0.5 and m["trace/cache_bytes"] == 9.0


def test_replay_refuses_a_stale_cache_and_rounds_to_nearest():
    cfg = _cfg()
    replay = TraceReplay.for_config(cfg)
    stale = TraceCacheBuilder(1, 1, config_fingerprint(cfg)).build()          # step 1's cache at step 2
    replay.load(stale, batch=None, step=2, version=2, timings={"trace/build_s": 0.1})
    assert replay.for_micro_batch(torch.arange(2), torch.arange(2)) is None
    m = replay.metrics()
    assert m["trace/rejected"] == 1 and m["trace/cache_bytes"] == 0.0 and m["trace/build_s"] == 0.1
    off = cfg.model_copy(update={"trace": cfg.trace.model_copy(update={"enabled": False})})
    assert TraceReplay.for_config(off) is None


def test_a_batch_carrying_trace_guides_is_refused_with_the_fix():
    with pytest.raises(BatchError, match="TraceReplay"):
        validate({"tokens": torch.zeros(1, 2, dtype=torch.long), "trace_guides": lambda ids, rows: None})


def test_colocated_ranks_exchange_their_records_under_dynamic_sampling(tmp_path):
    """Two colocated ranks, each engine recording its half of every generate call, DAPO refills (batch
    positions are not generation indices): each trainer rank's replay gets its samples' rows through the
    exchange and replays them (every layer cached, so guided codes equal the rollout's)."""
    from test_loop import DISAGG, _train

    got = _train(tmp_path / "colocated_traced", steps=2, nproc=2,
                 extra=DISAGG + ["trace.num_cached_layers=4", "rl.dynamic_sampling.enabled=true",
                                 "rl.dynamic_sampling.max_generate_calls=3", "run.eval_every=0"])
    for m in got:
        assert m["trace/rejected"] == 0 and m["trace/cache_bytes"] > 0 and m["trace/guided_rows"] > 0, m
        assert m["trace/code_mismatch_before"] > 0 and m["trace/code_mismatch_after"] == 0, m
