"""Weight sync: moving the learner's weights into the engines, versioned."""

from agentrl.weights.errors import (
    EnginesFailed,
    WeightGroupStale,
    WeightSyncError,
    WeightTransferError,
    WeightUpdateFailed,
)
from agentrl.weights.transfer import WeightReceiver, publish, serialize_state_dict
from agentrl.weights.updates import EngineUpdater

__all__ = ["EngineUpdater", "EnginesFailed", "WeightGroupStale", "WeightReceiver", "WeightSyncError",
           "WeightTransferError", "WeightUpdateFailed", "publish", "serialize_state_dict"]
