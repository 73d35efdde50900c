"""The OpenAI-compatible server: `scute serve` (server.py), its HTTP API (api.py, protocol.py, responses.py) over
an engine stepped on its own thread (async_engine.py), and its Prometheus metrics (metrics.py)."""
