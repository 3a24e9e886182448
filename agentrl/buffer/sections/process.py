"""Process rewards' section: a per-turn scorer's reward of each generated turn, on its last token.

``token_rewards``: float32 [tokens], NaN except on the last token of each scored turn
(:mod:`agentrl.scoring.stage` adds to it; :mod:`agentrl.learner.batch` turns it into the
return-to-go of each group's normalised step rewards). A sample with none has outcome reward only.
Bytes: f32 x tokens.
"""

from __future__ import annotations

from agentrl.buffer.sections.base import TokenFloats, register


@register
class TokenRewards(TokenFloats):
    name = "token_rewards"
    fields = ("token_rewards",)
