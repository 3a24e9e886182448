"""Weight sync: moving the learner's weights into the engines, versioned."""

from agentrl.weights.transfer import WeightReceiver, WeightTransferError, publish, serialize_state_dict

__all__ = ["WeightReceiver", "WeightTransferError", "publish", "serialize_state_dict"]
