"""SGLang rollout engine adapter: the RolloutEngine protocol over SGLang 0.5.15.post1 (docs/sglang.md).

Importing this package never imports SGLang: the in-process Engine is imported when a colocated engine
first runs, and the disaggregated client speaks HTTP with the standard library.

    from megatron_qrl.rollout.sglang import build_sglang_engine
    engine = build_sglang_engine(cfg)            # cfg.rollout.engine == "sglang"
"""
from .build import SGLangConfigError, build_sglang_engine
from .engine import SGLangEngine, verify_digests
from .payloads import RoutingLayout, SGLangResponseError, generate_request, parse_generate_response
from .quantization import EngineQuantization, UnsupportedQuantization, choose_engine_quantization
from .release import SGLANG_VERSION
from .trace_support import TraceUnsupportedError

__all__ = [
    "EngineQuantization", "RoutingLayout", "SGLANG_VERSION", "SGLangConfigError", "SGLangEngine",
    "SGLangResponseError", "TraceUnsupportedError", "UnsupportedQuantization", "build_sglang_engine",
    "choose_engine_quantization", "generate_request", "parse_generate_response", "verify_digests",
]
