"""Sample sections: each feature's own data on a sample, declared beside the feature (see
:mod:`agentrl.buffer.sections.base` for the interface and its invariants).

Importing this package registers the built-in sections: the behaviour (kept sets and sampling
settings), process rewards, MoE routing, and the teacher's logprobs and top-k (on-policy
distillation). A section declared elsewhere (a test, a
plug-in) registers itself when its module is imported.
"""

from agentrl.buffer.sections import behaviour, process, routing, teacher  # noqa: F401  (registers them)
from agentrl.buffer.sections.base import Section, TokenFloats, Values, holder, register, sections

__all__ = ["Section", "TokenFloats", "Values", "holder", "register", "sections"]
