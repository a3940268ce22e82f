"""Why the SGLang adapter refuses TRACE, and what SGLang would need to support it.

TRACE needs, per forwarded token and quantized site, the mantissa bits the engine's FP4 activation
quantizer chose (plus block / global scales). In the pinned release:
- the registry *is* open: `sglang.srt.layers.quantization.QUANTIZATION_METHODS` is a plain dict and
  `sglang.srt.server_args.add_quantization_method_choices` extends the CLI choices, so an outside package
  can register a method -- but only in the process that builds the model: the scheduler processes are
  spawned (`mp.set_start_method("spawn")`), so the registration must run at import time of a module the
  spawned children import (e.g. the launcher script itself);
- the FP4 activation quantization happens inside fused kernels (FlashInfer/CUTLASS quantize + GEMM,
  fused MoE) that return no codes, so a recording method would quantize every activation a second time
  with our codec (extra work on the hot path) and must reproduce the kernel's static `input_scale`;
- there is no per-request channel for per-token tensors from inside layers back to the response
  (routed experts have a dedicated capturer; `customized_info` is filled from the logits processor
  output only), and CUDA graphs / overlap scheduling would have to be kept in step.
So the adapter refuses TRACE; docs/sglang.md lists what an implementation would take.
"""
from __future__ import annotations


class TraceUnsupportedError(ValueError):
    """TRACE was requested with rollout.engine=sglang."""


TRACE_REFUSAL = ("TRACE rounding capture is not available with rollout.engine=sglang: SGLang's FP4 activation "
                 "quantization runs inside fused kernels that return no rounding bits, and the pinned release has "
                 "no per-token side channel to return them (docs/sglang.md, 'TRACE'). Set trace.enabled=false, or "
                 "use rollout.engine=embedded for TRACE runs.")


def refuse_trace(cfg) -> None:
    if cfg.trace.enabled:
        raise TraceUnsupportedError(TRACE_REFUSAL)
