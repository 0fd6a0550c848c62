"""Served models: typed endpoints, an async OpenAI-compatible client, vLLM launch and readiness."""
