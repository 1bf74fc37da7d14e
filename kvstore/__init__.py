"""kvstore: a tiered KV-cache offload store (pinned DRAM -> NVMe) for LLM serving."""
