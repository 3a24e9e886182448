"""vLLM engines: their launch options and serve's ``engine`` section (``config``), launching them here or
as Ray actors (``vllm``), the middleware that lets only serve talk to an engine it launched (``guard``),
a process group that dies with its parent (``reaper``) and MoE routing capture (``routing``). Nothing
is imported here, so ``agentrl.engines.config`` stays light."""
