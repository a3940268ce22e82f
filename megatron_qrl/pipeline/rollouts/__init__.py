"""The loop's `Rollouts` (protocol.py), one implementation per placement, and the engine ranks' side."""
from .colocated import ColocatedRollouts, engine_share, generate_shard
from .engine_ranks import EngineRank
from .protocol import Rollouts, RolloutsContext, SyncingRollouts
from .hand_over import trace_specs
from .remote import RemoteRollouts
from .sglang_servers import SGLangServerRollouts

__all__ = ["ColocatedRollouts", "EngineRank", "RemoteRollouts", "Rollouts", "RolloutsContext", "SGLangServerRollouts",
           "SyncingRollouts", "engine_share", "generate_shard", "trace_specs"]
