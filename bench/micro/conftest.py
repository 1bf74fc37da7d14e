"""Rigs for the engine-step micro-benchmarks (``make microbench``; not collected by CI).

A rig is what a vLLM engine with the kvstore connector holds, built through the public API the
connector uses (kvstore.offload: ``acquire_shared``, ``StepRunner``, ``LocalClient``, ``Planner``;
kvstore.kvcopy's layout over a numpy "engine" cache in vLLM's CPU layout): a real KVStore with a
DRAM tier and an NVMe tier (a temporary folder), no mocks. Its prompts are stored beforehand:

* ``dram`` prompts: put into the running store (resident in DRAM, write-back);
* ``nvme`` prompts: put by a first store on the same folder, closed (its DRAM persisted to NVMe),
  so the rig's store finds them at its start-up scan: NVMe only, as after a restart;
* ``miss`` prompts: never stored.

Every scenario is checked before it is timed (the tiers a lookup reports), so a before/after
comparison never compares two different walks. The same files run on any checkout whose venv
imports that checkout's kvstore (``kvstore_origin`` in the saved JSON says which one ran).
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import kvstore
from kvstore import kvcopy
from kvstore.config import from_dict
from kvstore.keys import ModelFingerprint, chain_keys
from kvstore.offload import LocalClient, StepRunner, Planner, acquire_shared, release_shared

try:  # the public face after issue 30; kvstore.store before it
    from kvstore import KVStore
except ImportError:  # pragma: no cover - depends on the checkout
    from kvstore.store import KVStore

BS = 16  # tokens per block (vLLM's GPU default; the CPU backend needs 32, the store does not care)
SIZES = (1024, 8192)  # prompt tokens: 64 and 512 blocks
# (layers, kv heads, head size), fp16: small = 8 KiB blocks (every step but begin_store), large =
# 128 KiB blocks (begin_store at both: it reserves and must not touch the bytes)
GEOMETRY = {"small": (1, 2, 64), "large": (16, 2, 64)}
ROUNDS = int(os.environ.get("KVSTORE_MICRO_ROUNDS", "100"))  # timed calls per benchmark (one call a round)
WARMUP = 3


def tokens(kind: str, n: int, seed: int = 0) -> list[int]:
    """A prompt's token ids, distinct per (kind, n, seed)."""
    salt = sum(map(ord, kind)) * 1_000_003 + n * 7919 + seed
    return [int(x) for x in np.random.default_rng(salt).integers(1, 32000, n)]


def _config(path: str, dram_gb: float):
    # load_only_if_faster off: no hit is cut by the read-rate estimate (it would make a
    # scenario depend on what the machine measured before)
    return from_dict({"tiers": {"dram": {"capacity_gb": dram_gb, "ttl_s": None},
                                "nvme": {"path": path, "capacity_gb": 4, "ttl_s": None}},
                      "io": {"load_only_if_faster": False}})


def _blocks(n: int, block_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, block_bytes), dtype=np.uint8)


class Rig:
    """One engine's view of the store: the scheduler's Planner over a LocalClient, the worker's StepRunner."""

    def __init__(self, root: str, name: str, geometry: str, dram_gb: float):
        layers, heads, hs = GEOMETRY[geometry]
        n_engine_blocks = 2 * max(SIZES) // BS + 64
        self.caches = [np.zeros((n_engine_blocks, heads, BS, 2 * hs), np.float16) for _ in range(layers)]
        self.layout = kvcopy.KVLayout.from_vllm(self.caches)
        self.fp = ModelFingerprint(model=f"microbench-{geometry}", dtype="float16", block_size=BS,
                                   num_layers=layers, num_kv_heads=heads, head_size=hs,
                                   layout=f"micro.{self.layout.packing}")
        self.block_bytes = self.layout.block_bytes
        self.cfg = _config(os.path.join(root, "nvme"), dram_gb)
        # the nvme prompts: written by a first store, persisted to NVMe at its close
        first = KVStore(self.cfg, block_bytes=self.block_bytes, fingerprint=self.fp, block_tokens=BS)
        try:
            for n in SIZES:
                ks = chain_keys(first.root, tokens("nvme", n), BS)
                assert first.put(ks, _blocks(len(ks), self.block_bytes, n)) == len(ks)
        finally:
            first.close()
        self.shared = acquire_shared(name, self.cfg, self.fp, self.block_bytes, BS)
        self.store = self.shared.store
        self.store.wait_ready(120)  # the whole DRAM pool, pre-faulted
        self.root = self.store.root
        for n in SIZES:
            ks = chain_keys(self.root, tokens("dram", n), BS)
            assert self.store.put(ks, _blocks(len(ks), self.block_bytes, n + 1)) == len(ks)
        io = self.cfg.io
        self.mover = StepRunner(self.shared, async_saves=io.async_saves, async_loads=io.async_loads)
        self.mover.register(self.caches, self.layout)
        self.client = LocalClient(self.shared)
        # as the connector builds it (connectors/vllm/connector.py), in-process, TP 1
        self.planner = Planner(self.client, self.fp, BS, prefetch=True, async_loads=io.async_loads,
                               async_saves=io.async_saves)
        self._n = 0
        for kind in ("dram", "nvme", "miss"):
            for n in SIZES:
                self.check(kind, n)

    def check(self, kind: str, n: int) -> None:
        """The scenario is what it says: every full block in ``kind``'s tier (none for a miss)."""
        ks = chain_keys(self.root, tokens(kind, n), BS)
        m = self.store.contains_prefix(ks, record=False)
        if kind == "miss":
            assert m.num_blocks == 0, m
        else:
            assert m.num_blocks == len(ks) and set(m.tiers) == {kind}, (kind, n, m.num_blocks, set(m.tiers))

    def rid(self, tag: str) -> str:
        self._n += 1
        return f"{tag}-{self._n}"

    def block_table(self, n_tokens: int, offset: int = 0) -> list[int]:
        """Engine block ids for a request of ``n_tokens`` (+1 for the token it computes)."""
        return list(range(offset, offset + n_tokens // BS + 1))

    def new_request(self, kind: str, n: int, seed: int = 0):
        """A tracked, looked-up request (what get_num_new_matched_tokens leaves): (state, hit tokens)."""
        st = self.planner.track(self.rid(kind), tokens(kind, n, seed), n)
        return st, self.planner.lookup(st, 0)

    def finish(self, plans=(), req_ids=()) -> None:
        """End what a round left: the loads planned but not executed (their pins), the requests."""
        for plan in plans:
            for lp in list(plan.loads) + list(plan.async_loads):
                if lp.handle_id:
                    self.client.end_load(lp.handle_id)
        for r in req_ids:
            self.planner.finished(r)

    def drain(self) -> None:
        """Wait for pending pins to be planned and released, and every copy job to complete."""
        self.finish([self.planner.build_step([], [], {})])
        if self.shared.jobs is not None:
            self.shared.jobs.wait_idle(60)
        getattr(self.store, "flush", lambda: None)()

    def close(self) -> None:
        self.drain()
        self.mover.close()
        release_shared(self.shared)


@pytest.fixture(scope="session")
def rig(tmp_path_factory):
    r = Rig(str(tmp_path_factory.mktemp("rig-small")), "microbench-small/tp0", "small", dram_gb=1.0)
    yield r
    r.close()


@pytest.fixture(scope="session")
def rig_large(tmp_path_factory):
    r = Rig(str(tmp_path_factory.mktemp("rig-large")), "microbench-large/tp0", "large", dram_gb=0.25)
    yield r
    r.close()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Which checkout ran: the kvstore package imported, and its commit."""
    src = os.path.dirname(os.path.dirname(os.path.abspath(kvstore.__file__)))
    try:
        head = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
    except Exception:  # pragma: no cover
        head, dirty = "", False
    output_json["kvstore_origin"] = {"path": src, "commit": head, "dirty": dirty}
