"""vLLM engines: the pool the router and the weight updater both drive (``pool``: balancing, session
affinity, health, the pause gate; its hot-path HTTP client ``upstream``; the OpenAI-shaped ``errors``
it raises), their launch options and serve's ``engine`` section (``config``), launching them here or
as Ray actors (``vllm``), the middleware that lets only serve talk to an engine it launched (``guard``),
a process group that dies with its parent (``reaper``) and MoE routing capture (``routing``). Nothing
is imported here, so ``agentrl.engines.config`` stays light; nothing in this package imports the
router or the weight sync."""
