"""What ``kvstore inspect`` counts per namespace, for a folder (:mod:`kvstore.inspect_nvme`) and
for Redis (:mod:`kvstore.inspect_remote`) alike: blocks, bytes, payload bytes, codecs, and an
age histogram (since last use on NVMe, since written in Redis)."""

from __future__ import annotations

from kvstore.codecs.registry import CODEC_NAMES

AGE_BUCKETS = ((60, "<1m"), (600, "1m-10m"), (3600, "10m-1h"), (86400, "1h-1d"), (7 * 86400, "1d-7d"),
               (float("inf"), ">7d"))


def new_namespace(**extra) -> dict:
    return {"blocks": 0, "bytes": 0, "payload_bytes": 0, "codecs": {}, "age": {name: 0 for _, name in AGE_BUCKETS},
            "oldest_s": None, "newest_s": None, **extra}


def count_block(info: dict, nbytes: int, payload_len: int, codec_id: int, age: float) -> None:
    """One good block of ``nbytes`` (its payload, codec and age in seconds) into ``info``."""
    info["blocks"] += 1
    info["bytes"] += nbytes
    info["payload_bytes"] += payload_len
    codec = CODEC_NAMES.get(codec_id, str(codec_id))
    info["codecs"][codec] = info["codecs"].get(codec, 0) + 1
    age = max(0.0, age)
    info["age"][next(label for limit, label in AGE_BUCKETS if age < limit)] += 1
    info["oldest_s"] = age if info["oldest_s"] is None else max(info["oldest_s"], age)
    info["newest_s"] = age if info["newest_s"] is None else min(info["newest_s"], age)


def namespace_lines(name: str, ns: dict, age_what: str) -> list[str]:
    return [f"  {name}: {ns['blocks']} blocks, {ns['bytes'] / 2**20:.1f} MiB "
            f"(payload {ns['payload_bytes'] / 2**20:.1f} MiB), codecs {ns['codecs'] or '{}'}",
            f"    age (since {age_what}): " + "  ".join(f"{k} {v}" for k, v in ns["age"].items())]
