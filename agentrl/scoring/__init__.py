"""The scoring stage: an episode's scorers run between its end and the buffer (docs/scoring.md)."""

from agentrl._lazy import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    "agentrl.scoring.config": ["JudgeConfig", "ScoringConfig"],
    "agentrl.scoring.registry": ["get_scorer", "scorer", "split_at_token", "split_text"],
    "agentrl.scoring.stage": ["Judge", "ScoringStage", "generated_segments", "generated_turns"],
})
