"""Codecs: round-trip error bounds (int8, fp8), exact round trips (none, zstd), corrupt compressed
payloads are counted misses, zstd frames that declare more than a block or lie about their size
are refused before they allocate (issue 45), a codec mismatch is never served, and an NVMe
fp8+zstd store under a DRAM ``none`` tier through put / get / demotion / promotion / restart."""

from __future__ import annotations

import shutil
import tracemalloc

import numpy as np
import pytest
import torch

from kvstore.bench.faults.families import bombs
from kvstore.tiers import fileformat as ff
from kvstore.codecs import CodecError, Geometry, make_codec
from kvstore.config import ConfigError, from_dict
from kvstore.keys import ModelFingerprint
from kvstore.store import KVStore
from kvstore.tiers.nvme import NvmeTier

from conftest import check_store, make_keys, nvme_files, tiny_config

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HEAD = 64
ALL = ["none", "int8", "fp8", "zstd", "int8+zstd", "fp8+zstd"]
FP16 = ModelFingerprint(model="codec-test", dtype="float16", block_size=16, num_layers=2, num_kv_heads=2,
                        head_size=HEAD)
BB = 2 * 2 * 16 * 2 * HEAD * 2  # layers * kv * tokens * heads * head_size * 2 bytes = 16 KiB


def kv_like(n_elems: int, dtype: str, seed: int = 0) -> np.ndarray:
    """KV-ish values: per-row magnitudes spread over 3 decades, a few outlier channels, some zeros."""
    g = torch.Generator().manual_seed(seed)
    rows = n_elems // HEAD
    x = torch.randn(rows, HEAD, generator=g) * torch.logspace(-2, 1, rows)[torch.randperm(rows, generator=g)][:, None]
    x[:, 3] *= 20  # an outlier channel (as real K has)
    x[::7] = 0  # all-zero rows: scale 0 must decode to exact zeros
    return x.reshape(-1).to(TORCH[dtype]).view(torch.uint8).numpy().copy()


def roundtrip(name: str, raw: np.ndarray, dtype: str, level: int = 3):
    c = make_codec(name, Geometry(raw.nbytes, dtype, HEAD), level)
    enc = np.empty(c.encoded_bytes, np.uint8)
    n = c.encode(raw, enc)
    assert 0 < n <= c.encoded_bytes and (n == c.encoded_bytes or not c.fixed_size)
    out = np.full(raw.nbytes, 0xAB, np.uint8)
    c.decode(enc, n, out)
    return c, enc[:n].copy(), out


def as_f32(u8: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(u8.copy()).view(TORCH[dtype]).float()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["none", "zstd"])
def test_lossless_codecs_are_exact(name, dtype):
    raw = kv_like(4096, dtype)
    c, enc, out = roundtrip(name, raw, dtype)
    assert np.array_equal(out, raw) and c.lossless
    if name == "zstd":
        assert len(enc) < raw.nbytes  # shuffled KV-like bytes do compress


def test_zstd_incompressible_stored_raw_and_exact():
    raw = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8)
    c, enc, out = roundtrip("zstd", raw, "uint8")
    assert enc[0] == 0 and len(enc) == raw.nbytes + 1 and np.array_equal(out, raw)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["int8", "int8+zstd"])
def test_int8_error_within_half_a_scale(name, dtype):
    raw = kv_like(8192, dtype, seed=1)
    c, enc, out = roundtrip(name, raw, dtype)
    x, y = as_f32(raw, dtype).view(-1, HEAD), as_f32(out, dtype).view(-1, HEAD)
    scale = x.abs().amax(1, keepdim=True) / 127
    # scale/2 from rounding, plus the half-ulp of rounding the result back to the block dtype
    ulp = {"float16": 2**-11, "bfloat16": 2**-8, "float32": 2**-24}[dtype]
    assert bool(((y - x).abs() <= scale / 2 * (1 + 1e-5) + y.abs() * ulp + 1e-30).all())
    assert bool((y[x.abs().amax(1) == 0] == 0).all())
    n = raw.nbytes // c.geometry.itemsize
    assert c.encoded_bytes == n + 4 * (n // HEAD) + (0 if c.fixed_size else 1)  # codes + fp32 scales (+ mode)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["fp8", "fp8+zstd"])
def test_fp8_relative_error_within_e4m3_bound(name, dtype):
    raw = kv_like(8192, dtype, seed=2)
    c, enc, out = roundtrip(name, raw, dtype)
    x, y = as_f32(raw, dtype).view(-1, HEAD), as_f32(out, dtype).view(-1, HEAD)
    scale = x.abs().amax(1, keepdim=True) / 448
    ulp = {"float16": 2**-11, "bfloat16": 2**-8, "float32": 2**-24}[dtype]
    # e4m3: 3 mantissa bits -> relative 2**-4 (half an ulp) for normal codes; subnormal codes
    # (below 2**-6 in scaled units) have an absolute step of 2**-9 -> error <= 2**-10 * scale
    bound = x.abs() * 2**-4 + scale * 2**-10 + y.abs() * ulp
    assert bool(((y - x).abs() <= bound * (1 + 1e-5) + 1e-30).all())
    big = (x.abs() >= scale * 2**-6) & (x != 0)
    rel = ((y - x).abs() / x.abs())[big]
    assert float(rel.max()) <= 2**-4 + ulp * 1.01


def edge_groups(dtype: str) -> torch.Tensor:
    """Groups (rows of HEAD) at a dtype's edges, in float64: all +-max, max and random below it,
    0.999 of max, a normal row, rows of subnormal magnitude (deep ones too), one smallest
    subnormal among zeros, and zeros."""
    fi = torch.finfo(TORCH[dtype])
    g = torch.Generator().manual_seed(3)
    r = torch.rand(HEAD, generator=g, dtype=torch.float64) * 2 - 1
    sign = torch.where(torch.rand(HEAD, generator=g) < 0.5, -1.0, 1.0).double()
    smallest = fi.tiny * fi.eps  # the smallest subnormal: 2**-24, 2**-133, 2**-149
    rows = [sign * fi.max, torch.cat([torch.tensor([fi.max], dtype=torch.float64), r[1:] * fi.max]),
            r / r.abs().max() * fi.max * 0.999, r, r * fi.tiny * 0.5, r * fi.tiny * 2**-8, r * fi.tiny * 2**-13,
            torch.zeros(HEAD, dtype=torch.float64).index_fill_(0, torch.tensor([5]), smallest),
            torch.zeros(HEAD, dtype=torch.float64)]
    return torch.stack(rows).to(TORCH[dtype]).double()  # what the block holds, exactly


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["int8", "fp8", "int8+zstd", "fp8+zstd"])
def test_lossy_codecs_at_the_dtypes_edges(name, dtype):
    """Issue 45 finding 9: a float32 group whose max is near float32's max decoded to inf (int8),
    and groups of subnormal magnitude came back off by ~100 % (float32) or as e4m3 NaN codes
    that no decode accepts (bfloat16 fp8): the codes were ``x * (1 / scale)``, whose reciprocal
    overflows. Now every group decodes finite, within the documented bound (int8: scale / 2;
    fp8: 2**-4 relative, 2**-10 * scale absolute), plus half an ulp of the block dtype (its
    smallest subnormal where the result is subnormal), and no group that is not all zeros gets
    scale 0."""
    x = edge_groups(dtype)
    raw = x.to(TORCH[dtype]).reshape(-1).view(torch.uint8).numpy().copy()
    c, enc, out = roundtrip(name, raw, dtype)
    y = as_f32(out, dtype).double().view(-1, HEAD)
    assert bool(torch.isfinite(y).all()), y.abs().amax(1)
    fi = torch.finfo(TORCH[dtype])
    qmax = 127 if name.startswith("int8") else 448
    scale = x.abs().amax(1, keepdim=True) / qmax
    rounding = y.abs() * fi.eps / 2 + fi.tiny * fi.eps  # the result's rounding to the dtype
    if name.startswith("int8"):
        bound = scale / 2 * (1 + 1e-5) + rounding
    else:
        bound = x.abs() * 2**-4 * (1 + 1e-5) + scale * 2**-10 + rounding
    err = (y - x).abs()
    assert bool((err <= bound).all()), (err / bound).amax(1)
    assert bool((y[x.abs().amax(1) == 0] == 0).all())
    q = c if c.fixed_size else c.inner
    if not c.fixed_size:
        enc = np.empty(q.encoded_bytes, np.uint8)
        q.encode(raw, enc)
    scales = torch.from_numpy(enc[: q.scale_bytes].copy()).view(torch.float32)
    assert torch.equal(scales > 0, x.abs().amax(1) > 0)  # only an all-zero group has scale 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fp8_decode_matches_torch_cast_for_every_code(dtype):
    """The fast fp8 decoder (float16 bit moves) equals torch's e4m3 cast for all 254 finite codes,
    subnormals and signed zeros included; e4m3's NaN codes are rejected."""
    group = 256
    c = make_codec("fp8", Geometry(4 * group * TORCH[dtype].itemsize, dtype, group))
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[~torch.isnan(codes.view(torch.float8_e4m3fn).float())]
    assert finite.numel() == 254
    q = torch.cat([finite, finite[:2]]).repeat(4)  # 4 groups of 256 codes
    scales = torch.tensor([1.0, 0.0, 3.7e-3, 123.25], dtype=torch.float32)
    enc = np.concatenate([scales.numpy().view(np.uint8), q.numpy()])
    out = np.empty(c.block_bytes, np.uint8)
    c.decode(enc, enc.size, out)
    want = (q.view(torch.float8_e4m3fn).float().view(4, group) * scales[:, None]).to(TORCH[dtype])
    got = torch.from_numpy(out).view(TORCH[dtype]).view(4, group)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 stays -0
    for nan in (0x7F, 0xFF):
        bad = enc.copy()
        bad[scales.numel() * 4 + 17] = nan
        with pytest.raises(CodecError):
            c.decode(bad, bad.size, out)


def test_lossy_needs_a_known_dtype_and_a_dividing_group():
    with pytest.raises(ValueError, match="dtype"):
        make_codec("fp8", Geometry(4096, "uint8", 64))
    with pytest.raises(ValueError, match="divide"):
        make_codec("int8", Geometry(4096, "float16", 48))
    with pytest.raises(ValueError, match="dtype"):  # a store keyed by raw digest bytes has no dtype
        KVStore(from_dict({"tiers": {"dram": {"capacity_gb": 0}, "nvme": {"codec": "int8"}}}),
                block_bytes=4096, fingerprint=b"x" * 16)


@pytest.mark.parametrize("name", ["zstd", "fp8+zstd", "int8"])
def test_decoder_rejects_damaged_bytes(name):
    raw = kv_like(4096, "float16")
    c, enc, out = roundtrip(name, raw, "float16")
    with pytest.raises(CodecError):
        c.decode(enc, len(enc) - 1 if c.fixed_size else c.encoded_bytes + 1, out)
    if not c.fixed_size:
        bad = enc.copy()
        bad[1:9] = 0xFF  # the zstd frame's magic and header
        with pytest.raises(CodecError):
            c.decode(bad, len(bad), out)
        bad = enc.copy()
        bad[0] = 7  # unknown mode byte
        with pytest.raises(CodecError):
            c.decode(bad, len(bad), out)


def _traced_peak(fn) -> int:
    """The most bytes Python's allocators held at once while ``fn`` ran (python-zstandard's
    output buffers included), over what they held before."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("frame", sorted(bombs.hostile_payloads(BB, BB + 1)))
@pytest.mark.parametrize("name", ["zstd", "int8+zstd"])
def test_zstd_refuses_a_frame_that_is_not_one_block_before_it_allocates(name, frame):
    """Issue 45 findings 1-2: python-zstandard allocates what a frame declares, whatever
    ``max_output_size`` says: a frame declaring 4 GiB allocated 4 GiB (and decoded it: 9-10 s, 4.1
    GiB of RSS), one declaring 1 TiB raised MemoryError. Every frame that declares another size
    than the block's, or holds another, is a CodecError, allocating at most a block or two."""
    c = make_codec(name, Geometry(BB, "float16", HEAD))
    payload = np.frombuffer(bombs.hostile_payloads(c.inner.encoded_bytes, c.encoded_bytes)[frame], np.uint8)
    assert len(payload) <= c.encoded_bytes
    out = np.zeros(BB, np.uint8)

    def decode():
        with pytest.raises(CodecError, match=r"zstd|frame"):
            c.decode(payload, len(payload), out)

    assert _traced_peak(decode) < 4 * BB


def test_zstd_streams_a_frame_of_unknown_size_up_to_one_block():
    """A frame without a content size (kvstore never writes one) is streamed, capped: exactly a
    block decodes (the bytes it holds), one byte more or less is refused."""
    c = make_codec("zstd", Geometry(BB, "uint8"))
    out = np.zeros(BB, np.uint8)
    exact = np.frombuffer(bombs.payload(bombs.UNKNOWN, BB, byte=9), np.uint8)
    c.decode(exact, len(exact), out)
    assert (out == 9).all()
    for n in (BB - 1, BB + 1):
        bad = np.frombuffer(bombs.payload(bombs.UNKNOWN, n, byte=9), np.uint8)
        with pytest.raises(CodecError, match=f"exactly {BB}"):
            c.decode(bad, len(bad), out)


def test_zstd_refuses_a_second_frame_after_the_block():
    """python-zstandard 0.25 decodes the first frame only and by default ignores what follows: a
    block's own frame followed by a bomb decoded as the block. Nothing kvstore writes has a
    second frame: refused, the bomb never decoded."""
    c = make_codec("zstd", Geometry(BB, "uint8"))
    two = np.frombuffer(bombs.payload(BB, BB, byte=9) + bombs.frame(4 << 30, 1 << 20), np.uint8)
    with pytest.raises(CodecError, match="unused data"):
        c.decode(two, len(two), np.zeros(BB, np.uint8))


def test_config_zstd_level_and_dram_codec():
    assert from_dict({}).tiers.nvme.zstd_level == 3
    assert from_dict({"tiers": {"nvme": {"zstd_level": 19}}}).tiers.nvme.zstd_level == 19
    with pytest.raises(ConfigError, match="tiers.nvme.zstd_level"):
        from_dict({"tiers": {"nvme": {"zstd_level": 0}}})
    with pytest.raises(ConfigError, match="tiers.dram.codec"):
        KVStore(from_dict({"tiers": {"dram": {"codec": "fp8", "capacity_gb": 0.001}, "nvme": {"capacity_gb": 0}}}),
                block_bytes=BB, fingerprint=FP16)


# -- through the store --------------------------------------------------------------------------


def codec_config(path, codec: str, *, dram_blocks: int = 4, nvme_blocks: int = 32, header: str = "inline", **kw):
    cfg = tiny_config(path, dram_blocks=dram_blocks, nvme_blocks=nvme_blocks, block_bytes=BB, header=header, **kw)
    d = cfg.to_dict()
    d["tiers"]["nvme"]["codec"] = codec
    if dram_blocks == 0:
        d["tiers"]["dram"]["capacity_gb"] = 0
    return from_dict(d)


def kv_blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.stack([kv_like(BB // 2, "float16", seed * 1000 + i) for i in range(n)])


def close_enough(out: np.ndarray, raw: np.ndarray, codec: str) -> bool:
    if codec in ("none", "zstd"):
        return np.array_equal(out, raw)
    x, y = as_f32(raw, "float16"), as_f32(out, "float16")
    tol = 2**-4 if codec.startswith("fp8") else 1 / 127
    return bool(((y - x).abs() <= x.view(-1, HEAD).abs().amax(1).repeat_interleave(HEAD) * tol + 1e-3).all())


def M(store, name, **labels):
    return store.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("header", ["inline", "xattr"])
@pytest.mark.parametrize("codec", ALL)
def test_store_roundtrip_demote_promote_restart(tmp_path, clock, codec, header):
    path = tmp_path / "c"
    keys = make_keys(12, fp=FP16)
    raw = kv_blocks(12)
    s = KVStore(codec_config(path, codec, header=header), block_bytes=BB, fingerprint=FP16, clock=clock)
    try:
        assert s.put(keys, raw) == 12  # 4 DRAM slots: the other 8 go (encoded) to NVMe
        s.flush()
        assert len(s.nvme) >= 8 and len(nvme_files(s)) >= 8
        out = np.zeros_like(raw)
        assert s.get(keys, out) == 12  # promotion decodes
        assert all(close_enough(out[i], raw[i], codec) for i in range(12))
        if codec != "none":
            assert s.nvme.codec is not None and s.nvme.codec.name == codec
        files = nvme_files(s)
        enc_max = s.nvme.file_bytes
        if codec in ("int8", "fp8", "int8+zstd", "fp8+zstd"):
            assert enc_max < ff.file_bytes(BB) or header == "xattr"  # fewer bytes per block
        assert all(p.stat().st_size <= enc_max for p in files)
        check_store(s)
    finally:
        s.close()  # writes the DRAM-only blocks down
    s2 = KVStore(codec_config(path, codec, header=header), block_bytes=BB, fingerprint=FP16, clock=clock)
    try:
        assert len(s2.nvme) == 12
        assert s2.nvme.used_bytes == sum(p.stat().st_size for p in nvme_files(s2))  # real sizes accounted
        out = np.zeros_like(raw)
        assert s2.get(keys, out) == 12
        assert all(close_enough(out[i], raw[i], codec) for i in range(12))
        check_store(s2)
    finally:
        s2.close()


def test_zstd_files_are_smaller_and_capacity_counts_real_sizes(tmp_path, clock):
    s = KVStore(codec_config(tmp_path / "c", "fp8+zstd", dram_blocks=0), block_bytes=BB, fingerprint=FP16,
                clock=clock)
    try:
        keys = make_keys(8, fp=FP16)
        assert s.put(keys, kv_blocks(8)) == 8
        sizes = [p.stat().st_size for p in nvme_files(s)]
        assert s.nvme.used_bytes == sum(sizes) < 8 * ff.file_bytes(BB)
        check_store(s)
    finally:
        s.close()


def test_corrupt_compressed_payload_is_a_counted_miss(tmp_path, clock):
    s = KVStore(codec_config(tmp_path / "c", "fp8+zstd", dram_blocks=0), block_bytes=BB, fingerprint=FP16,
                clock=clock)
    try:
        keys = make_keys(4, fp=FP16)
        s.put(keys, kv_blocks(4))
        p = s.nvme.path_of(keys[2])
        with open(p, "r+b") as f:  # flip a byte of the compressed payload: the checksum catches it
            f.seek(ff.HEADER_BYTES + 40)
            b = f.read(1)
            f.seek(ff.HEADER_BYTES + 40)
            f.write(bytes([b[0] ^ 0x5A]))
        out = np.zeros((4, BB), np.uint8)
        assert s.get(keys, out) == 2 and not p.exists()
        assert M(s, "kvstore_corrupt_files_total", tier="nvme", reason="bad_checksum") == 1
        assert s.contains_prefix(keys).miss_reason == "corrupt"
        check_store(s)
    finally:
        s.close()


def test_undecodable_payload_with_a_valid_checksum_is_a_counted_miss(tmp_path, clock, monkeypatch):
    """A frame that passes the checksum but does not decompress (a writer bug, a foreign zstd): a
    miss, counted as ``bad_payload``, removed; never an exception to the caller."""
    s = KVStore(codec_config(tmp_path / "c", "zstd", dram_blocks=0), block_bytes=BB, fingerprint=FP16, clock=clock)
    try:
        keys = make_keys(3, fp=FP16)
        real = s.nvme.codec.encode

        def broken(src, dst):
            n = real(src, dst)
            dst[1:n] = 0x42  # garbage after a "zstd" mode byte
            return n

        s.put(keys[:1], kv_blocks(1))
        monkeypatch.setattr(s.nvme.codec, "encode", broken)
        s.put(keys[1:2], kv_blocks(1, seed=1))
        monkeypatch.setattr(s.nvme.codec, "encode", real)
        s.put(keys[2:], kv_blocks(1, seed=2))
        out = np.zeros((3, BB), np.uint8)
        assert s.get(keys, out) == 1
        assert M(s, "kvstore_corrupt_files_total", tier="nvme", reason="bad_payload") == 1
        assert not s.nvme.path_of(keys[1]).exists()
        check_store(s)
    finally:
        s.close()


@pytest.mark.parametrize("frame", sorted(bombs.hostile_payloads(BB, BB + 1)))
def test_a_zstd_bomb_in_a_block_file_is_a_counted_miss(tmp_path, clock, monkeypatch, frame):
    """Issue 45: a file whose valid header and checksum cover a frame that declares 4 GiB or
    1 TiB, or lies about its size: a miss counted ``bad_payload``, the file removed, nothing
    allocated beyond a block or two. Before, the 1 TiB frame's MemoryError failed its read uncounted
    (and every read of the blocks beside it in the same I/O part), the file staying for the next."""
    s = KVStore(codec_config(tmp_path / "c", "zstd", dram_blocks=0), block_bytes=BB, fingerprint=FP16, clock=clock)
    try:
        keys = make_keys(3, fp=FP16)
        c = s.nvme.codec
        payload = np.frombuffer(bombs.hostile_payloads(c.inner.encoded_bytes, c.encoded_bytes)[frame], np.uint8)
        real = c.encode

        def bomb(src, dst):
            dst[: len(payload)] = payload
            return len(payload)

        s.put(keys[:1], kv_blocks(1))
        monkeypatch.setattr(c, "encode", bomb)
        s.put(keys[1:2], kv_blocks(1, seed=1))
        monkeypatch.setattr(c, "encode", real)
        s.put(keys[2:], kv_blocks(1, seed=2))
        out = np.zeros((3, BB), np.uint8)
        got = []
        assert _traced_peak(lambda: got.append(s.get(keys, out))) < 4 * BB + (1 << 20)
        assert got == [1]
        assert M(s, "kvstore_corrupt_files_total", tier="nvme", reason="bad_payload") == 1
        assert not s.nvme.path_of(keys[1]).exists()
        assert s.contains_prefix(keys).miss_reason == "corrupt"
        check_store(s)
    finally:
        s.close()


def test_codec_mismatch_is_never_served(tmp_path, clock):
    """The same folder and keys under another NVMe codec: other namespace (nothing found); a file
    of another codec planted under this namespace: refused as foreign."""
    path = tmp_path / "c"
    keys = make_keys(4, fp=FP16)
    raw = kv_blocks(4)
    for codec in ("fp8", "none", "int8+zstd"):
        s = KVStore(codec_config(path, codec, dram_blocks=0), block_bytes=BB, fingerprint=FP16, clock=clock)
        if codec == "fp8":
            s.put(keys, raw)
            fp8_root = s.nvme.root
        else:
            assert s.nvme.root != fp8_root
            assert s.contains_prefix(keys).num_blocks == 0 and s.get(keys, np.zeros_like(raw)) == 0
        s.close()
    # plant the fp8 files in the int8+zstd namespace folder: same keys, wrong namespace and codec
    s = KVStore(codec_config(path, "int8+zstd", dram_blocks=0), block_bytes=BB, fingerprint=FP16, clock=clock)
    root = s.nvme.root
    s.close()
    for k in keys:
        src = fp8_root / k.hex()[:2] / (k.hex() + ff.SUFFIX)
        dst = root / k.hex()[:2] / (k.hex() + ff.SUFFIX)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    s = KVStore(codec_config(path, "int8+zstd", dram_blocks=0), block_bytes=BB, fingerprint=FP16, clock=clock)
    try:
        assert len(s.nvme) == 0 and s.get(keys, np.zeros_like(raw)) == 0
        assert M(s, "kvstore_corrupt_files_total", tier="nvme", reason="foreign") == 4
    finally:
        s.close()
    # a tier given the same namespace but another codec refuses the file by its codec id
    t = NvmeTier(path=path, namespace=KVStore_namespace(FP16, "fp8"), capacity_bytes=1 << 24, ttl_s=None,
                 policy="lru", block_bytes=BB, header="inline",
                 codec=make_codec("int8", Geometry(BB, "float16", HEAD)))
    try:
        assert len(t) == 0 and t.corrupt_reasons.get("foreign") == 4
    finally:
        t.close()


def KVStore_namespace(fp, codec: str) -> bytes:
    import xxhash

    from kvstore.keys import root_of

    return xxhash.xxh3_128_digest(root_of(fp) + f"codec={codec}".encode() + f",dtype=float16,group={HEAD}".encode())

