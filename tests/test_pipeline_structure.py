"""megatron_qrl/pipeline's structure: no import cycle, capabilities chosen once (job.py, sync/__init__.py), and
the small pieces the loop is assembled from (plan_rank, the commands engine ranks follow, the retry policy)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from megatron_qrl.config import load_config

PIPELINE = Path(__file__).resolve().parents[1] / "megatron_qrl" / "pipeline"
# the two places that pick an implementation by placement / engine / capability
CHOICE_POINTS = {"job.py", "sync/__init__.py"}
CAPABILITY_SWITCH = re.compile(r"lora\.enabled|rollout\.engine\s*[!=]=|rollout\.placement\s*[!=]=|\.disaggregated\b"
                               r"|hasattr\(\s*s\.rollouts|trainer is (not )?None")


def _modules() -> dict[str, Path]:
    out = {}
    for p in PIPELINE.rglob("*.py"):
        rel = p.relative_to(PIPELINE).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(("megatron_qrl.pipeline",) + parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """Pipeline modules `name` imports (at any depth of the file: lazy imports count too)."""
    base = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            pkg = base.split(".")[: len(base.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(pkg + ([node.module] if node.module else []))
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):   # a package's own parents are not cycles
                out.add(t)
    return out


def _cycle(graph: dict) -> list:
    """One import cycle of `graph` as a list of modules, or []."""
    state: dict = {}

    def visit(v, stack):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w, stack)):
                return found
        state[v] = 2
        stack.pop()
        return []

    for v in sorted(graph):
        if v not in state and (found := visit(v, [])):
            return found
    return []


def test_pipeline_has_no_import_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert not _cycle(graph), " -> ".join(_cycle(graph))


def test_the_cycle_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def _code_without_strings(path: Path) -> str:
    """The module's code with docstrings, strings and comments blanked (the switch must be in code to count)."""
    keep = [tok.string for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if tok.type not in (tokenize.STRING, tokenize.COMMENT)]
    return re.sub(r"\s*([.()])\s*", r"\1", " ".join(keep))


def test_pipeline_branches_on_no_capability_outside_its_choice_points():
    offenders = {}
    for path in PIPELINE.rglob("*.py"):
        rel = path.relative_to(PIPELINE).as_posix()
        if rel in CHOICE_POINTS:
            continue
        found = [m.group(0) for m in CAPABILITY_SWITCH.finditer(_code_without_strings(path))]
        if found:
            offenders[rel] = found
    assert not offenders, f"capability switches outside {sorted(CHOICE_POINTS)}: {offenders}"
    # and the choice points do choose
    assert CAPABILITY_SWITCH.search(_code_without_strings(PIPELINE / "job.py"))


# ------------------------------------------------------------------------------------- plan_rank
def _cfg(*overrides):
    return load_config("configs/tiny_cpu.yaml", list(overrides))


SGLANG = ["rollout.engine=sglang", "trace.enabled=false", "rollout.sglang_model_path=/ckpt/tiny-nvfp4"]


@pytest.mark.parametrize("overrides, world, rank, trains, engines, assemble", [
    ([], 2, 1, True, "EmbeddedEngines", "_colocated"),
    (["rollout.placement=disaggregated"], 2, 0, True, None, "_remote_trainer"),
    (["rollout.placement=disaggregated"], 2, 1, False, "EmbeddedEngines", "_engine_rank"),
    (SGLANG, 1, 0, True, "SGLangEngines", "_colocated"),
    (SGLANG + ["rollout.placement=disaggregated", "rollout.sglang_server_urls=[http://fake:30000]"], 2, 0, True,
     "SGLangEngines", "_sglang_servers"),
    (SGLANG + ["rollout.placement=disaggregated", "rollout.sglang_server_urls=[http://fake:30000]"], 2, 1, True,
     None, "_sglang_servers"),
])
def test_plan_rank_resolves_each_side_once(overrides, world, rank, trains, engines, assemble):
    from megatron_qrl.pipeline.job import EngineSide, TrainerSide, plan_rank

    plan = plan_rank(_cfg(*overrides), world, rank)
    assert plan.trains is trains and plan.assemble.__name__ == assemble
    assert (type(plan.engines).__name__ if plan.engines is not None else None) == engines
    assert isinstance(plan.side(object()), TrainerSide if trains else EngineSide)


# ------------------------------------------------------------------------------------ interfaces
def test_every_rollouts_and_weight_sync_implements_its_protocol():
    from megatron_qrl.pipeline.rollouts import (ColocatedRollouts, RemoteRollouts, Rollouts,
                                                SGLangServerRollouts)
    from megatron_qrl.pipeline.sync import (BroadcastSync, InProcessSync, LoRASync, SGLangServerSync, SGLangSync,
                                            WeightSync)

    for r in (ColocatedRollouts(None, None), RemoteRollouts(None, None, None, None), SGLangServerRollouts(None, None)):
        assert isinstance(r, Rollouts), type(r).__name__
    for w in (InProcessSync(None, None, None), LoRASync(None, None, None), SGLangSync(None, None, None),
              SGLangServerSync(None, None, None), BroadcastSync(None, None, None)):
        assert isinstance(w, WeightSync), type(w).__name__


class _Channel:
    def __init__(self, incoming=()):
        self.sent, self.incoming = [], list(incoming)

    def send(self, command):
        self.sent.append(command)

    def receive(self):
        return self.incoming.pop(0)


class _Weights:
    def __init__(self, log):
        self.log = log

    def push(self, step, *, version=None, aqn=True):
        self.log.append(("push", step, aqn))
        return {"aqn/sigma": 0.0}


def test_remote_rollouts_command_the_engines_before_pushing_and_stop_them_only_on_a_clean_end():
    from megatron_qrl.pipeline.commands import Generate, Save, Stop
    from megatron_qrl.pipeline.rollouts import RemoteRollouts

    log = []
    channel = _Channel()
    channel.send = lambda c: log.append(c)
    r = RemoteRollouts(None, None, _Weights(log), channel)
    r.sync(3)
    r.save(4)
    with pytest.raises(ZeroDivisionError):
        with r:
            1 / 0
    assert log == [Generate(3), ("push", 3, True), Save(4)]    # no Stop after an unexpected exception
    with pytest.raises(SystemExit):
        with r:
            raise SystemExit(3)                                # a stop at a step boundary releases the engines
    with r:
        pass
    assert log[3:] == [Stop(), Stop()]


def test_engine_ranks_follow_typed_commands_until_stop():
    from megatron_qrl.pipeline.commands import Evaluate, Generate, Save, Stop
    from megatron_qrl.pipeline.rollouts import EngineRank

    rank = EngineRank.__new__(EngineRank)
    seen = []
    rank.commands = _Channel([Generate(0), Save(1), Evaluate(1), Generate(1), Stop(), Generate(2)])
    rank._handlers = {kind: seen.append for kind in (Generate, Evaluate, Save)}
    rank.follow_commands()
    assert seen == [Generate(0), Save(1), Evaluate(1), Generate(1)]


def test_an_untyped_message_is_refused_with_the_fix(monkeypatch):
    import megatron_qrl.pipeline.commands as commands

    monkeypatch.setattr(commands.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(commands, "broadcast_object", lambda obj, src, group: {"cmd": "stop"})
    with pytest.raises(TypeError, match="unknown command .* same megatron_qrl version"):
        commands.CommandChannel(group=None).receive()


# ---------------------------------------------------------------------------------- retry policy
def test_engine_retry_restarts_a_failed_engine_then_returns_the_retried_batch():
    from megatron_qrl.pipeline.retry import EngineRetry

    calls, restarts = [], []

    def generate():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("engine died")
        return ["rollout"]

    retry = EngineRetry(max_retries=2)
    assert retry.run(generate, lambda: restarts.append(1), step=0) == ["rollout"]
    assert len(calls) == 2 and len(restarts) == 1 and retry.restarts == 1


def test_engine_retry_gives_up_after_max_retries_and_waits_for_the_other_ranks():
    from megatron_qrl.pipeline.retry import EngineFailure, EngineRetry

    def broken():
        raise RuntimeError("engine died")

    restarts = []
    with pytest.raises(EngineFailure, match=r"failed 2 times .*rollout.max_generate_retries=1.*engine died"):
        EngineRetry(max_retries=1).run(broken, lambda: restarts.append(1), step=5)
    assert len(restarts) == 1
    # this rank succeeded, another failed (agree says so): retried together, no restart of its own engine
    votes = iter([True, False])
    retry = EngineRetry(max_retries=1, agree=lambda failed: next(votes))
    assert retry.run(lambda: ["ok"], lambda: restarts.append(2), step=5) == ["ok"]
    assert restarts == [1] and retry.restarts == 1
