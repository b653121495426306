"""tiering: a tiered store for LLM KV-cache blocks."""
