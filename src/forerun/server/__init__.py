"""``forerun serve`` (an OpenAI-compatible HTTP server over the batch engine) and ``forerun loadtest``."""
