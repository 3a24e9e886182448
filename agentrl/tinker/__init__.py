"""A Tinker-compatible training service on agentrl's learner parts (``agentrl tinker``).

Programs written against the Tinker API (the official ``tinker`` SDK, and the tinker-cookbook on it)
point ``ServiceClient(base_url=...)`` at this service and train LoRA adapters on a model served
here: :mod:`~agentrl.tinker.service` (routes, tenants, futures), :mod:`~agentrl.tinker.trainer`
(adapters and optimizers on one base), :mod:`~agentrl.tinker.losses` (the built-in losses) and
:mod:`~agentrl.tinker.wire` (the SDK's JSON and protobuf messages). docs/tinker.md says what is
supported.
"""
