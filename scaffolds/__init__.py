"""Reference scaffolds: agent programs that only see an OpenAI endpoint (see README.md here)."""
