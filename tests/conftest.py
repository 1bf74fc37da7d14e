"""Shared fixtures: a fake clock, temporary store folders, a tiny config builder, block helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvstore.tiers import fileformat as ff  # noqa: E402
from kvstore.config import GiB, StoreConfig, from_dict  # noqa: E402
from kvstore.tiers.index import READY  # noqa: E402
from kvstore.keys import ModelFingerprint, chain_keys  # noqa: E402

BLOCK = 8192  # default test block size (a multiple of 4 KiB: O_DIRECT in place)
ODD_BLOCK = 5000  # a size that is not: bounce buffers and padding
FP = ModelFingerprint(model="tiny-test", dtype="float16", block_size=16, num_layers=2, num_kv_heads=2, head_size=8)


def in_process_vllm():
    """vLLM for a test module that runs engines in this process (the module is skipped without
    it): a 1 GiB CPU KV cache unless set, no model hub, the engine core in this process."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return pytest.importorskip("vllm")


def prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of a random prompt (ids 4-499: inside the tiny models' vocabulary)."""
    return [int(x) for x in np.random.default_rng(seed).integers(4, 500, size=n)]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The folder of a tiny random Llama (256 hidden, 4 layers), built once per test process;
    a module that needs another shape defines its own ``tiny_model``."""
    from kvstore.bench.common.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), hidden=256, layers=4, seed=0)


class FakeClock:
    """A settable clock: ``clock()`` reads it, ``clock.advance(s)`` moves it forward."""

    def __init__(self, start: float = 1_700_000_000.0):
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> float:
        self.t += s
        return self.t

    def set(self, t: float) -> None:
        self.t = float(t)


def dram_gb(blocks: int, block_bytes: int = BLOCK) -> float:
    """capacity_gb holding exactly ``blocks`` DRAM slots (exact in binary floating point)."""
    return blocks * ff.round_up(block_bytes) / GiB


def nvme_gb(blocks: int, block_bytes: int = BLOCK) -> float:
    """capacity_gb holding exactly ``blocks`` NVMe files."""
    return blocks * ff.file_bytes(block_bytes) / GiB


def tiny_config(path: str | os.PathLike | None, *, dram_blocks: int = 4, nvme_blocks: int = 16,
                block_bytes: int = BLOCK, dram_ttl: float | None = None, nvme_ttl: float | None = None,
                policy: str = "lru", nvme_policy: str | None = None, write_mode: str = "write_back",
                o_direct="auto", io_threads: int = 2, pin_memory=False, header: str = "inline",
                headroom=0, engine: str | None = None) -> StoreConfig:
    """``dram_blocks`` is what the DRAM index holds; ``headroom`` more slots (none by default, so
    a test's evictions are exact) are kept for victims still being written down. ``engine``:
    ``tiers.nvme.engine`` (None: the default, auto, which takes a batch's page-aligned buffers;
    "off" for a test that drives the tier's own per-block path)."""
    if headroom != "auto":
        dram_blocks += headroom
    return from_dict({
        "tiers": {
            "dram": {"capacity_gb": dram_gb(dram_blocks, block_bytes), "ttl_s": dram_ttl, "policy": policy,
                     "pin_memory": pin_memory, "headroom_blocks": headroom},
            "nvme": {"path": None if path is None else str(path), "capacity_gb": nvme_gb(nvme_blocks, block_bytes),
                     "ttl_s": nvme_ttl, "policy": nvme_policy or policy, "write_mode": write_mode,
                     "o_direct": o_direct, "io_threads": io_threads, "header": header,
                     **({} if engine is None else {"engine": engine})},
        }
    })


def block_for(key: bytes, block_bytes: int = BLOCK) -> np.ndarray:
    """Deterministic content for a key (so a test can check bytes without keeping them)."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 256, block_bytes, dtype=np.uint8)


def blocks_for(keys, block_bytes: int = BLOCK) -> np.ndarray:
    out = np.empty((len(keys), block_bytes), np.uint8)
    for i, k in enumerate(keys):
        out[i] = block_for(k, block_bytes)
    return out


def make_keys(n: int, seed: int = 0, fp: ModelFingerprint = FP) -> list[bytes]:
    """A chain of ``n`` block keys (one prompt)."""
    toks = np.random.default_rng(seed).integers(0, 50_000, n * fp.block_size)
    return chain_keys(fp, toks, fp.block_size)


def one_key(i: int) -> bytes:
    """An independent key (its own one-block chain), for tests where chains do not matter."""
    return make_keys(1, seed=10_000 + i)[0]


def _nvme_of(store_or_tier):
    from kvstore.store import KVStore

    return store_or_tier.nvme if isinstance(store_or_tier, KVStore) else store_or_tier


def nvme_files(store_or_tier) -> list[Path]:
    """Block files currently on disk for a store's (or tier's) namespace folder."""
    tier = _nvme_of(store_or_tier)
    return sorted(p for p in Path(tier.root).rglob("*" + ff.SUFFIX) if p.parent.parent == Path(tier.root))


def tmp_files(store_or_tier) -> list[Path]:
    tier = _nvme_of(store_or_tier)
    return sorted(Path(tier.tmp).iterdir())


def check_tier(tier, quiescent: bool = True) -> None:
    """Index invariants; when nothing is in flight also: no pins, no WRITING, medium consistent."""
    with tier.lock:
        tier.index.check()
        if not quiescent:
            return
        for e in tier.index.entries.values():
            assert e.pins == 0, f"leaked pin on {e.key.hex()}"
            assert e.state == READY, f"entry left WRITING: {e.key.hex()}"
        if tier.name == "dram":
            slots = [e.slot for e in tier.index.entries.values()]
            assert all(s >= 0 for s in slots)
            assert len(set(slots)) == len(slots), "two entries share a DRAM slot"
            assert tier.pool.n_free == tier.pool.ready_slots - len(slots), "DRAM slots leaked"
        if tier.name == "nvme":
            on_disk = {bytes.fromhex(p.name[:-len(ff.SUFFIX)]) for p in nvme_files(tier)}
            assert on_disk == set(tier.index.entries), "NVMe files and index disagree"


def check_store(store) -> None:
    for t in store.tiers:
        check_tier(t)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store_dir(tmp_path) -> Path:
    """A not-yet-existing cache folder (the NVMe tier creates it 0700)."""
    return tmp_path / "cache"


@pytest.fixture
def make_store(store_dir, clock):
    """Factory: ``make_store(**tiny_config kwargs, block_bytes=..., fingerprint=..., path=...)``.
    Stores are closed at teardown."""
    from kvstore.store import KVStore

    made = []

    def _make(*, block_bytes: int = BLOCK, fingerprint=FP, path=None, clk=None, config=None, **kw):
        cfg = config or tiny_config(path or store_dir, block_bytes=block_bytes, **kw)
        s = KVStore(cfg, block_bytes=block_bytes, fingerprint=fingerprint, block_tokens=fingerprint.block_size
                    if isinstance(fingerprint, ModelFingerprint) else 16, clock=clk or clock)
        made.append(s)
        return s

    yield _make
    for s in made:  # a test may end holding pins (a request mid-flight): the close need not wait 30 s for them
        s.close(wait_s=0)
