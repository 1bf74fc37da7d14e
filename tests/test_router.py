"""The reference router (bench/route/router.py, issue 32) on vLLM's own event types: its index follows
BlockStored/BlockRemoved per engine and medium, a prefix is scored with llm-d's weights, and it
falls back to the least-loaded engine. The whole bench (engines, events, Redis): ``kvstore bench
route``, results in docs/routing.md."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

from kvstore.bench.route.router import Router  # noqa: E402

BS = 4


def stored(hashes, parent, tokens, medium, group=0):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def test_prefix_scores_follow_the_event_streams():
    r = Router(3, "prefix", block_size=BS)
    p = list(range(100, 112))  # three blocks
    # engine 0: the first two blocks on its GPU (its own hashes); engine 1: all three in kvstore's DRAM
    # (other hashes: engines hash differently, the index keys blocks by tokens and parent)
    r.apply(0, [stored([11, 12], None, p[:8], "GPU")])
    r.apply(1, [stored([21], None, p[:4], "CPU"), stored([22, 23], 21, p[4:12], "CPU")])
    assert r.index.scores(p, 3) == [2.0, pytest.approx(2.4), 0.0]
    assert r.pick("s", p) == 1
    r.apply(1, [BlockRemoved(block_hashes=[22], medium="CPU")])  # block 2 leaves engine 1's DRAM
    assert r.index.scores(p, 3) == [2.0, 0.8, 0.0]
    r.apply(1, [stored([22], 21, p[4:8], "STORAGE")])  # ... demoted to its NVMe
    assert r.index.scores(p, 3)[1] == pytest.approx(0.8 + 0.4 + 0.8)  # the prefix is whole again
    r.apply(0, [AllBlocksCleared()])  # vLLM's reset: engine 0's GPU blocks are gone
    assert r.index.scores(p, 3)[0] == 0.0
    r.apply(2, [stored([99], 98, p[4:8], "CPU")])  # its parent never seen: cannot be placed
    assert r.index.skipped == 1
    r.apply(2, [stored([31], None, p[:4], "GPU", group=1)])  # another KV cache group: not a prefix
    assert r.index.scores(p, 3)[2] == 0.0


def test_fallback_is_the_least_loaded_engine_and_the_other_policies():
    r = Router(2, "prefix", block_size=BS)
    assert r.pick("a", list(range(8))) == 0  # nothing known: least loaded
    assert r.pick("b", list(range(8))) == 1
    assert r.fallbacks == 2
    rr = Router(3, "round_robin", block_size=BS)
    assert [rr.pick("x", []) for _ in range(4)] == [0, 1, 2, 0]
    s = Router(3, "session", block_size=BS)
    assert len({s.pick("conv-1", []) for _ in range(5)}) == 1
    with pytest.raises(ValueError, match="policy"):
        Router(2, "random", block_size=BS)


def test_prefix_and_load_are_weighed_as_llm_d_does():
    """3 x the prefix share + 2 x the queue score: a whole prefix in HBM outweighs any load; a
    loaded engine holding half of it loses to an idle one holding none."""
    r = Router(2, "prefix", block_size=BS)
    p = list(range(200, 216))  # four blocks
    r.apply(0, [stored([1, 2, 3, 4], None, p, "GPU")])
    r.load = [5, 0]
    assert r.pick("a", p) == 0  # 3 x 1.0 + 0 > 0 + 2 x 1
    r = Router(2, "prefix", block_size=BS)
    r.apply(0, [stored([1, 2], None, p[:8], "GPU")])
    assert r.pick("a", p) == 0  # idle both: the half prefix decides
    assert r.pick("b", p) == 1  # engine 0 has one in flight: 3 x 0.5 + 0 < 0 + 2 x 1
    assert r.fallbacks == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_bench_route_end_to_end(capsys):
    """The whole bench, small: 2 engine processes with kvstore, a shared Redis, 3 sessions x 2 turns
    one at a time. Round robin moves a session's second turn to the other engine (3 sessions on
    2 engines), which loads its history from Redis; the prefix policy reads the engines' events."""
    from kvstore.bench.route import main

    res = main(["--sessions", "3", "--turns", "2", "--system-tokens", "256", "--policies", "round_robin,prefix",
                "--redis", "on", "--concurrency", "1", "--json"])
    rr, px = res["rows"]
    assert (rr["policy"], px["policy"]) == ("round_robin", "prefix")
    assert rr["requests"] == px["requests"] == 6 and rr["requests_per_engine"] == [3, 3]
    assert sum(px["requests_per_engine"]) == 6
    assert rr["kvstore_share"]["remote"] > 0  # the moved turns' history, from Redis
    assert rr["engine_local_share"] > 0  # the system prompt, in each engine's own cache
    assert px["events"] > 0 and px["unplaced_events"] == 0 and px["prefix_fallbacks"] >= 1
    assert '"rows"' in capsys.readouterr().out
