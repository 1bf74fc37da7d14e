"""Thin engine adapters for kvstore (vLLM first). No policy and no I/O here."""
