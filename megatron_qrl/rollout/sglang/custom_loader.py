"""The weight loaders this project registers with SGLang's `--custom-weight-loader` (ServerArgs.custom_weight_loader).

In the pinned release (0.5.15.post1) `ModelRunner.update_weights_from_tensor` dispatches a `load_format` listed
in `server_args.custom_weight_loader` to `dynamic_import(load_format)(self.model, named_tensors)`; no other
update path has a hook, and every path ends in `model.load_weights` without re-running
`process_weights_after_loading` (docs/sglang.md). So an FP4 update is framed by two calls through that hook:

    update_weights_from_tensor(named_tensors=[], load_format=BEGIN_FP4_UPDATE)      # open the session
    ... the buckets, through update_weights_from_tensor or update_weights_from_distributed as before ...
    update_weights_from_tensor(named_tensors=[], load_format=END_FP4_UPDATE)        # re-process touched layers

An empty list carries no tensor, so the framing calls also work over HTTP from another host (the buckets
themselves go through NCCL). LOAD_FP4_UPDATE does all three in one call for a single-call update.
Any tensors passed to the framing calls are loaded inside the session.

SGLang imports these functions in its scheduler processes, so megatron-qrl must be installed where SGLang runs.
An exception here ends the SGLang server (its scheduler turns one into SIGQUIT to its parent process).
"""
from __future__ import annotations

import base64
import logging
import pickle

from .reprocess import close_session, load, open_session

logger = logging.getLogger(__name__)

_MODULE = __name__
BEGIN_FP4_UPDATE = f"{_MODULE}.begin_fp4_update"
END_FP4_UPDATE = f"{_MODULE}.end_fp4_update"
LOAD_FP4_UPDATE = f"{_MODULE}.load_fp4_update"
CUSTOM_WEIGHT_LOADERS = [BEGIN_FP4_UPDATE, END_FP4_UPDATE, LOAD_FP4_UPDATE]


def begin_fp4_update(model, named_tensors) -> None:
    """Open the FP4 reload session (then load any tensors given)."""
    open_session(model)
    load(model, named_tensors)


def end_fp4_update(model, named_tensors) -> None:
    """Load any tensors given, then re-run post-load processing for the FP4 layers the session touched."""
    load(model, named_tensors)
    done = close_session(model)
    logger.info("FP4 reload: re-processed %d layer(s) after the weight update", len(done))


def load_fp4_update(model, named_tensors) -> None:
    """begin + load + end in one call."""
    begin_fp4_update(model, named_tensors)
    end_fp4_update(model, [])


def empty_serialized_named_tensors(tp_size: int) -> list[str]:
    """`serialized_named_tensors` of /update_weights_from_tensor for an empty list, one entry per TP rank.

    The release base64-decodes each string and unpickles it (MultiprocessingSerializer / SafeUnpickler); a pickled
    empty list needs no tensor reducer, so plain pickle produces the same bytes SGLang's ForkingPickler would."""
    return [base64.b64encode(pickle.dumps([], protocol=pickle.HIGHEST_PROTOCOL)).decode()] * int(tp_size)
