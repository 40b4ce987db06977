"""OpenAI-compatible endpoints (/v1/models, /v1/completions, /v1/chat/completions)."""
