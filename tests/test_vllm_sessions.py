"""Sessions through the connector (issue 32): a request's session is vLLM's own ``session_id``,
else ``kv_transfer_params: {"kvstore": {"session": ...}}``, never the cache salt (which isolates
tenants). It feeds the trace (``kvstore explain``) and the shared-block TTL class
(``ttl_shared_s``, and ``lru_shared``): a block counts as shared when two sessions hit it, not two
turns of one conversation."""

from __future__ import annotations


import pytest

from conftest import in_process_vllm  # noqa: E402

vllm = in_process_vllm()

from kvstore.bench.common.engine import Engine, connector_config, kv_transfer  # noqa: E402
from kvstore.keys import chain_keys  # noqa: E402
from kvstore.offload import shared as shared_mod  # noqa: E402
from kvstore.trace import read_trace  # noqa: E402
from conftest import prompt  # noqa: E402

pytestmark = [pytest.mark.vllm]

BS = 32


def test_sessions_group_requests_and_share_the_system_prompt(tiny_model, tmp_path):
    from vllm import SamplingParams

    trace = tmp_path / "trace.jsonl"
    cfg = connector_config(None, dram_gb=0.05, nvme_gb=0)
    cfg["tiers"]["dram"].update(ttl_s=100, ttl_shared_s=1000)
    cfg["trace_path"] = str(trace)
    eng = Engine(tiny_model, block_size=BS, max_len=2048, kv_transfer=kv_transfer(cfg))
    n = iter(range(100))

    def turn(p: list[int], *, session_id: str | None = None, hint: str | None = None, salt: str | None = None,
             tag: str = "agent"):
        kv = {"tag": tag, **({"session": hint} if hint else {})}
        extra = {"kv_transfer_params": {"kvstore": kv}}
        inp = {"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})}
        e = eng.llm.llm_engine
        e.add_request(f"r{next(n)}", inp, SamplingParams(max_tokens=2, temperature=0, extra_args=extra),
                      session_id=session_id)
        while e.has_unfinished_requests():
            e.step()
        eng.reset()  # vLLM forgets it: the next turn's hit comes from kvstore

    try:
        system = prompt(2 * BS, 1)  # two blocks every session starts with
        a1 = system + prompt(BS + 5, 2)
        turn(a1, session_id="conv-a")
        turn(a1 + prompt(BS, 3), session_id="conv-a")  # conv-a's later turns hit system and a1's block
        turn(a1 + prompt(BS, 6), session_id="conv-a")
        store = shared_mod.live()[0].store
        dram = store.dram
        keys = chain_keys(store.root, a1, BS)
        sys_keys, a_key = keys[:2], keys[2]

        def shared(k):
            return dram.index.entries[k].shared

        assert not any(shared(k) for k in sys_keys)  # two turns of one conversation: not shared
        turn(system + prompt(BS + 7, 4), hint="conv-b")  # another conversation, no salt: it hits the system prompt
        assert all(shared(k) for k in sys_keys) and not shared(a_key)
        assert dram.index.entries[sys_keys[0]].ttl == 1000 and dram.index.entries[a_key].ttl is None
        turn(system + prompt(BS + 7, 5), hint="conv-c", salt="tenant-2", tag="tenant-2")  # its own tenant: no hit
        summary = shared_mod.live()[0].metrics.summary()
    finally:
        eng.close()
    recs = list(read_trace(trace))
    assert [r.session for r in recs] == ["conv-a", "conv-a", "conv-a", "conv-b", "conv-c"]
    assert [r.hit_tokens for r in recs] == [0, 3 * BS, 3 * BS, 2 * BS, 0]
    # request tags (kv_transfer_params kvstore.tag): in the trace, the metrics and kvstore stats
    assert [r.tag for r in recs] == ["agent"] * 4 + ["tenant-2"]
    tags = summary["tags"]
    assert tags["agent"]["hit_tokens"] == 8 * BS and tags["tenant-2"]["hit_tokens"] == 0
    assert tags["agent"]["prompt_tokens"] == sum(r.prompt_tokens for r in recs[:4])
    assert tags["agent"]["hit_rate"] == pytest.approx(8 * BS / sum(r.prompt_tokens for r in recs[:4]))
    from kvstore.offload.readout import render_engine

    assert any(line.strip().startswith("agent") for line in render_engine(summary))
