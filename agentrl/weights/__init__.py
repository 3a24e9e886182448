"""Weight sync: moving the learner's weights into the engines, versioned."""

from agentrl.weights.errors import WeightGroupStale, WeightSyncError, WeightUpdateFailed
from agentrl.weights.transfer import (
    EnginesFailed,
    WeightReceiver,
    WeightTransferError,
    publish,
    serialize_state_dict,
)

__all__ = ["EnginesFailed", "WeightGroupStale", "WeightReceiver", "WeightSyncError", "WeightTransferError",
           "WeightUpdateFailed", "publish", "serialize_state_dict"]
