"""Block keys: a stable hash chain seeded by the model fingerprint."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.keys import KEY_BYTES, ModelFingerprint, chain_keys, encode, next_key, root_of

from conftest import FP, ROOT

BS = 16
TOKENS = [int(x) for x in np.random.default_rng(7).integers(0, 2**31, 10 * BS + 5)]


def test_key_shape_and_count():
    keys = chain_keys(FP, TOKENS, BS)
    assert len(keys) == 10  # only full blocks; the 5 trailing tokens get no key
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == len(keys)
    assert chain_keys(FP, TOKENS[: BS - 1], BS) == []
    assert chain_keys(FP, [], BS) == []


def test_input_types_agree():
    a = chain_keys(FP, TOKENS, BS)
    assert chain_keys(FP, np.array(TOKENS, dtype=np.int64), BS) == a
    assert chain_keys(FP, np.array(TOKENS, dtype=np.uint32), BS) == a
    assert chain_keys(FP, tuple(TOKENS), BS) == a
    assert chain_keys(FP.digest(), TOKENS, BS) == a  # a root digest works like the fingerprint


_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from kvstore.keys import ModelFingerprint, chain_keys
spec = json.loads(sys.argv[2])
fp = ModelFingerprint(**spec["fp"])
keys = chain_keys(fp, spec["tokens"], spec["bs"], extra=spec["extra"])
print(json.dumps([fp.hex()] + [k.hex() for k in keys]))
"""


def test_identical_across_processes():
    spec = {"fp": {k: v for k, v in dataclasses.asdict(FP).items() if k != "extra"}, "tokens": TOKENS, "bs": BS,
            "extra": "lora-a"}
    ours = [FP.hex()] + [k.hex() for k in chain_keys(FP, TOKENS, BS, extra="lora-a")]
    for seed in ("0", "12345"):  # Python's hash() randomization must not matter
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), json.dumps(spec)], env=env,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        assert json.loads(out) == ours


def test_known_value_is_stable():
    """Pin the format: changing the hash or encoding silently orphans every cache on disk."""
    fp = ModelFingerprint(model="m")
    k = chain_keys(fp, list(range(4)), 4)
    assert len(k) == 1
    # recompute by hand from the documented construction
    import struct

    import xxhash
    fields = {k: v for k, v in dataclasses.asdict(fp).items() if k != "packing"}  # named by layout already
    root = xxhash.xxh3_128_digest(b"kvstore-fp-v1" + encode(fields))
    assert root_of(fp) == root and root.hex() == "9410fbf5949bf8780fab3cf5669328d8"  # as before the packing field existed
    typed = ModelFingerprint(model="m", layout="kvblock-v1.std", packing="std")
    assert typed.digest() == ModelFingerprint(model="m", layout="kvblock-v1.std").digest()
    toks = np.arange(4, dtype="<u4").tobytes()
    assert k[0] == xxhash.xxh3_128_digest(root + struct.pack("<I", len(toks)) + toks)


_ALT = {str: "other", int: 99, tuple: ("x",)}


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(ModelFingerprint) if f.name != "packing"])
def test_every_fingerprint_field_changes_the_keys(field):
    cur = getattr(FP, field)
    alt = _ALT[type(cur)]
    if alt == cur:
        alt = cur + 1 if isinstance(cur, int) else cur + "x"
    fp2 = dataclasses.replace(FP, **{field: alt})
    assert fp2.digest() != FP.digest()
    a, b = chain_keys(FP, TOKENS, BS), chain_keys(fp2, TOKENS, BS)
    assert not set(a) & set(b)


def test_packing_is_the_layouts():
    """``packing`` is typed for the worker's check, and named by ``layout`` (which the digest
    covers): one that ``layout`` does not name is refused."""
    assert ModelFingerprint(model="m", layout="kvblock-v1.vllm_cpu-vec", packing="vllm_cpu").packing == "vllm_cpu"
    with pytest.raises(ValueError, match="packing 'std'"):
        ModelFingerprint(model="m", layout="kvblock-v1.vllm_cpu-vec", packing="std")


def test_extra_keys_change_the_keys():
    base = chain_keys(FP, TOKENS, BS)
    lora = chain_keys(FP, TOKENS, BS, extra="lora-a")
    lora2 = chain_keys(FP, TOKENS, BS, extra="lora-b")
    salt = chain_keys(FP, TOKENS, BS, extra={"salt": "s1"})
    assert len({tuple(base), tuple(lora), tuple(lora2), tuple(salt)}) == 4
    assert not set(base) & set(lora)
    assert chain_keys(FP, TOKENS, BS, extra="lora-a") == lora  # deterministic
    # per-block extras (e.g. multimodal hashes): a change in block 3 changes keys 3.. only
    per = [None] * 10
    per2 = list(per)
    per2[3] = b"image-hash"
    k1 = chain_keys(FP, TOKENS, BS, extra_per_block=per)
    k2 = chain_keys(FP, TOKENS, BS, extra_per_block=per2)
    assert k1[:3] == k2[:3] and all(x != y for x, y in zip(k1[3:], k2[3:]))
    with pytest.raises(ValueError):
        chain_keys(FP, TOKENS, BS, extra_per_block=[None] * 3)


def test_extra_encoding_is_type_tagged():
    # values that print alike must not collide
    ks = {chain_keys(FP, TOKENS[:BS], BS, extra=e)[0] for e in (1, "1", 1.0, b"1", True, [1], (1,), None)}
    assert len(ks) == 7  # [1] and (1,) encode alike on purpose (both sequences)
    with pytest.raises(TypeError):
        encode(object())
    assert encode({"b": 1, "a": 2}) == encode({"a": 2, "b": 1})


@pytest.mark.parametrize("pos", [0, 1, BS - 1, BS, 5 * BS + 3, 10 * BS - 1])
def test_any_token_in_the_prefix_changes_that_block_and_all_after(pos):
    a = chain_keys(FP, TOKENS, BS)
    t2 = list(TOKENS)
    t2[pos] ^= 1
    b = chain_keys(FP, t2, BS)
    blk = pos // BS
    assert a[:blk] == b[:blk]
    assert all(x != y for x, y in zip(a[blk:], b[blk:]))


def test_prefix_property():
    full = chain_keys(FP, TOKENS, BS)
    for n in range(0, len(TOKENS) + 1, 7):
        assert chain_keys(FP, TOKENS[:n], BS) == full[: n // BS]


def test_parent_continues_the_chain():
    full = chain_keys(FP, TOKENS, BS)
    for k in range(1, 9):
        assert chain_keys(FP, TOKENS[k * BS:], BS, parent=full[k - 1]) == full[k:]
    assert next_key(full[1], TOKENS[2 * BS:3 * BS]) == full[2]


def test_block_size_is_part_of_the_chain():
    assert chain_keys(FP, TOKENS[:32], 16)[0] != chain_keys(FP, TOKENS[:32], 32)[0]


def test_bad_inputs():
    with pytest.raises(ValueError):
        chain_keys(FP, TOKENS, 0)
    with pytest.raises(ValueError):
        chain_keys(FP, [-1] * BS, BS)
    with pytest.raises(ValueError):
        chain_keys(FP, [2**32] * BS, BS)
    for bad in ([-1] * BS, [2**32] * BS, np.full(BS, -1, dtype=np.int64)):  # next_key validates alike
        with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
            next_key(root_of(FP), bad)
    with pytest.raises(TypeError):
        chain_keys(b"short", TOKENS, BS)
    with pytest.raises(TypeError):
        root_of("a string")
