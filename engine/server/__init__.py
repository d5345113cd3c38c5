"""The OpenAI-compatible HTTP layer over the engine: protocol, routes, chat, output, metrics, shutdown."""
