"""mlxkv: a KV-cache runtime for LLM inference on MLX.

Concurrent requests that share a prompt prefix reuse the KV state an earlier
request computed. The synchronous, seed-compatible cache layer lives in
:mod:`mlxkv.cache`.
"""

__version__ = "0.1.0"
