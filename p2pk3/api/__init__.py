"""The OpenAI-compatible HTTP API over the ring: `p2pk3 serve` (server.py), routes (app.py), request
validation (schema.py), streaming (sse.py, generation.py, stops.py), the cluster connection (cluster.py),
Prometheus metrics (metrics.py), and `start_api_in_background` (background.py) for `p2pk3 local --api`."""

from .background import ApiProcess, start_api_in_background

__all__ = ["ApiProcess", "start_api_in_background"]
