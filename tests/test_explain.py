"""``kvstore explain``: each turn against the previous turn of its session, on hand-written
traces (every class, with and without token ids), through the CLI, and through a real vLLM
engine fed each cache-busting pattern (one engine start)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvstore.ops.explain import APPEND, FIRST, HEAD, LOST, REWRITE, UNKNOWN, Explainer, classify, explain, explain_file
from kvstore.ops.explain_report import render
from kvstore.keys import chain_keys
from kvstore.trace import TraceRecord, TraceWriter, parse_line, read_trace

BT = 4
ROOT_KEY = b"\x01" * 16


def toks(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(4, 500, n)]


def rec(session: str, t: float, tokens: list[int], *, hit: int | None = None, local: int = 0,
        reason: str | None = None, keep_tokens: bool = False, extra=None) -> TraceRecord:
    blocks = tuple(chain_keys(ROOT_KEY, tokens, BT, extra=extra))
    return TraceRecord(t, session, blocks, BT, len(tokens), 4, local_tokens=None if hit is None else local,
                       hit_tokens=hit, miss_reason=reason, tokens=tuple(tokens) if keep_tokens else None)


SYS = toks(8, 1)  # two blocks of "system prompt"


def test_first_turn_and_append_only():
    a = SYS + toks(6, 2)  # 14 tokens: 3 full blocks, 3 may be offered
    b = a + toks(7, 3)  # 21 tokens
    assert classify(None, rec("s", 0, a)).cls == FIRST
    tn = classify(rec("s", 0, a), rec("s", 1, b, hit=12), 2)
    assert (tn.cls, tn.shared_blocks, tn.want_blocks, tn.got_blocks, tn.lost_tokens) == (APPEND, 3, 3, 3, 0)
    assert tn.diverged_block is None and tn.diverged_token is None
    # the engine's own prefix cache counts as got: 8 local + 4 from kvstore
    assert classify(rec("s", 0, a), rec("s", 1, b, hit=4, local=8)).cls == APPEND
    # a shorter resend (a regenerate) shares all its blocks: not a divergence
    assert classify(rec("s", 0, b), rec("s", 1, a, hit=12)).cls == APPEND


@pytest.mark.parametrize("keep_tokens", [False, True])
def test_head_changed_at_block_0_and_1(keep_tokens):
    ts1, ts2 = [7, 7, 7, 11], [7, 7, 7, 12]  # a timestamp at the top, differing in its last token
    prev, cur = ts1 + SYS + toks(3, 4), ts2 + SYS + toks(3, 4) + toks(9, 5)  # 15 tokens (3 blocks), 24
    tn = classify(rec("s", 0, prev, keep_tokens=keep_tokens), rec("s", 1, cur, hit=0, keep_tokens=keep_tokens), 2)
    assert (tn.cls, tn.diverged_block, tn.diverged_tokens) == (HEAD, 0, (0, 4))
    assert tn.lost_tokens == 3 * BT  # the previous prompt's 3 full blocks were all reusable
    if keep_tokens:
        assert tn.diverged_token == 3
        assert tn.context == {"from": 0, "previous": prev[:10], "this": cur[:10]}
    else:
        assert tn.diverged_token is None and tn.context is None
    # block 1 is still the head; block 2 is history
    p2 = SYS + toks(8, 6)
    c1 = p2[:5] + [p2[5] + 1] + p2[6:] + toks(4, 7)
    c2 = p2[:9] + [p2[9] + 1] + p2[10:] + toks(4, 7)
    assert classify(rec("s", 0, p2), rec("s", 1, c1, keep_tokens=True)).cls == HEAD
    tn = classify(rec("s", 0, p2, keep_tokens=True), rec("s", 1, c2, keep_tokens=True))
    assert (tn.cls, tn.diverged_block, tn.diverged_token) == (REWRITE, 2, 9)


@pytest.mark.parametrize("keep_tokens", [False, True])
def test_history_rewritten(keep_tokens):
    prev = SYS + toks(16, 8)  # 24 tokens, 6 blocks
    cur = list(prev)
    cur[13] += 1  # an earlier tool result edited: block 3
    cur += toks(6, 9)
    tn = classify(rec("s", 0, prev, keep_tokens=keep_tokens), rec("s", 1, cur, hit=12, keep_tokens=keep_tokens))
    assert (tn.cls, tn.diverged_block, tn.diverged_tokens) == (REWRITE, 3, (12, 16))
    assert tn.lost_tokens == (6 - 3) * BT
    assert tn.diverged_token == (13 if keep_tokens else None)
    if keep_tokens:
        assert tn.context["from"] == 7 and tn.context["previous"][6] == prev[13] != tn.context["this"][6]


def test_expired_or_evicted_it_would_have_hit():
    prev = SYS + toks(8, 10)  # 16 tokens: 4 blocks; the next turn may be offered all 4
    cur = prev + toks(5, 11)
    tn = classify(rec("s", 0, prev), rec("s", 1, cur, hit=0, reason="evicted"))
    assert (tn.cls, tn.reason, tn.want_blocks, tn.got_blocks, tn.lost_tokens) == (LOST, "evicted", 4, 0, 16)
    tn = classify(rec("s", 0, prev), rec("s", 1, cur, hit=4, local=4, reason="expired"))  # 2 of 4 blocks
    assert (tn.cls, tn.reason, tn.lost_tokens) == (LOST, "expired", 8)
    # the prompt's last token is never offered: a prompt ending on a block boundary wants one less
    tn = classify(rec("s", 0, prev), rec("s", 1, prev + toks(4, 12), hit=16))
    assert tn.cls == APPEND
    tn = classify(rec("s", 0, prev + toks(4, 12)), rec("s", 1, prev + toks(4, 12), hit=16))
    assert (tn.shared_blocks, tn.want_blocks, tn.cls) == (5, 4, APPEND)
    # a trace without hit fields cannot tell: append_unknown (never healthy, never 0 lost), and which fields lack
    r = explain([rec("s", 0, prev), rec("s", 1, cur)])
    assert r["classes"][APPEND]["turns"] == 0 and r["classes"][UNKNOWN]["turns"] == 1 and r["hits_recorded"] is False
    assert r["classes"][UNKNOWN]["lost_tokens"] is None and r["lost_tokens_unknown_turns"] == 1
    assert r["fields_missing"] == {"local_tokens": 2, "hit_tokens": 2, "miss_reason": 2, "replay": 2, "tokens": 2}
    text = render(r)
    assert "| expired_evicted | unknown | unknown | unknown |" in text and "| append_only | unknown |" in text
    assert "reusable tokens lost: unknown (1 append-only turns" in text and "hit_tokens (2 of 2" in text


def test_same_tokens_other_extra_keys():
    a = SYS + toks(4, 13)
    tn = classify(rec("s", 0, a, keep_tokens=True, extra="lora-a"),
                  rec("s", 1, a + [5], keep_tokens=True, extra="lora-b"))
    assert tn.cls == HEAD and tn.diverged_token is None and "extra keys" in tn.note


def test_report_shares_sessions_time_order_and_bounded_examples():
    recs = []
    for s in range(6):  # head changed in every session, losing more in later sessions
        body = SYS + toks(4 * (s + 1), 20 + s)
        recs += [rec(f"h{s}", 10.0 * s, [1000 + s] + body), rec(f"h{s}", 10.0 * s + 1, [2000 + s] + body, hit=0)]
    base = SYS + toks(8, 40)
    recs += [rec("a", 100.0, base), rec("a", 101.0, base + toks(4, 41), hit=16),
             rec("e", 102.0, base), rec("e", 103.0, base + toks(4, 42), hit=0, reason="expired")]
    recs.append(rec("one", 104.0, toks(9, 43)))
    r = explain(list(reversed(recs)), examples=2, max_sessions=3)  # the file order does not matter: t does
    c = r["classes"]
    assert (r["requests"], r["sessions"], r["followup_turns"], r["single_request_sessions"]) == (17, 9, 8, 1)
    assert [c[k]["turns"] for k in (FIRST, APPEND, HEAD, REWRITE, LOST)] == [9, 1, 6, 0, 1]
    assert c[HEAD]["share_of_followups"] == pytest.approx(6 / 8) and c[FIRST]["share_of_followups"] is None
    assert r["expired_evicted_reasons"] == {"expired": 1} and r["hits_recorded"] is True
    assert r["divergence_blocks"] == {"0": 6}
    ex = r["examples"][HEAD]
    assert len(ex) == 2 and [e["session"] for e in ex] == ["h5", "h4"]  # the biggest losses
    assert ex[0]["turn"] == 2 and [e["lost_tokens"] for e in ex] == [8 * BT, 7 * BT]
    assert c[HEAD]["lost_tokens"] == sum((3 + s) * BT for s in range(6))
    assert r["examples"][LOST][0]["reason"] == "expired" and r["examples"][REWRITE] == []
    assert [s["session"] for s in r["sessions_top"]] == ["h5", "h4", "h3"]
    assert r["sessions_top"][0][HEAD] == 1 and r["sessions_top"][0][FIRST] == 1


def test_trace_lines_round_trip_and_old_lines_still_parse(tmp_path):
    from kvstore.tune.trace_memory import load_trace

    r = rec("s", 1.5, SYS + toks(3, 50), hit=4, local=0, reason="evicted", keep_tokens=True)
    r = TraceRecord(**{**{k: getattr(r, k) for k in r.__slots__}, "replay": True})
    assert parse_line(r.to_json()) == r
    old = '{"t":1,"session":"s","blocks":["' + "ab" * 16 + '"],"block_tokens":4,"prompt_tokens":5}'
    o = parse_line(old)
    assert o.tokens is None and o.hit_tokens is None and o.replay is None
    assert set(json.loads(TraceRecord(1.0, "s", (), 4, 0, 0).to_json())) == {  # None fields are left out
        "t", "session", "blocks", "block_tokens", "prompt_tokens", "output_tokens"}
    p = tmp_path / "t.jsonl"
    w = TraceWriter(p)
    w.write(r.t, r.session, r.blocks, BT, r.prompt_tokens, 4, hit_tokens=4, local_tokens=0, replay=False,
            tokens=r.tokens)
    w.write(2.0, "s", r.blocks, BT, r.prompt_tokens, 4)
    w.close()
    back = list(read_trace(p))
    assert back[0].tokens == r.tokens and back[0].hit_tokens == 4 and back[1].tokens is None
    assert load_trace(p).prompt_tokens == [11, 11]  # the tuner reads it, ignoring the new fields


def test_cli_json_text_and_plot(tmp_path, capsys):
    from kvstore.ops.cli import main

    p = tmp_path / "t.jsonl"
    prev = SYS + toks(12, 60)
    edited = list(prev)
    edited[14] += 1
    with open(p, "w") as f:
        for r in (rec("a", 0, prev, keep_tokens=True), rec("a", 1, edited + [9], hit=8, keep_tokens=True),
                  rec("b", 2, prev), rec("b", 3, prev + [5, 6], hit=0, reason="evicted")):
            f.write(r.to_json() + "\n")
    png = tmp_path / "explain.png"
    assert main(["explain", "--trace", str(p), "--json", "--plot", str(png)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["trace"] == str(p) and r["classes"][REWRITE]["turns"] == 1 and r["classes"][LOST]["turns"] == 1
    assert r["examples"][REWRITE][0]["diverged_token"] == 14
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["explain", "--trace", str(p)]) == 0
    text = capsys.readouterr().out
    assert "| history_rewritten | 1 | 50.0% |" in text and "token 14" in text and "evicted 1" in text
    assert main(["explain", "--trace", str(tmp_path / "missing.jsonl")]) == 2  # bad input: one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("kvstore explain: error: ") and "missing.jsonl" in err and err.count("\n") == 1


def test_what_a_trace_names_is_printed_escaped(tmp_path, capsys):
    """Finding 7: a session (an API client's session id) reached the terminal raw: an ESC drove
    it, a ``|`` broke the table, and ``$...$`` (matplotlib's math) stopped ``--plot``."""
    import re

    from kvstore.ops.cli import main

    p = tmp_path / "t.jsonl"
    prev = SYS + toks(12, 61)
    evil = ["\x1b[2J\x1b]0;owned\x07", "a|b\nc", "$\\frac{$", "rtl\u202e"]
    with open(p, "w") as f:
        for i, name in enumerate(evil):  # each session: a first turn, then one whose blocks were gone
            for r in (rec(name, 2 * i, prev), rec(name, 2 * i + 1, prev + [5, 6], hit=0, reason="\x1b[31mevicted")):
                f.write(r.to_json() + "\n")
    png = tmp_path / "explain.png"
    assert main(["explain", "--trace", str(p), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any(c in text for c in "\x1b\x07\u202e")
    assert "| \\x1b[2J\\x1b]0;owned\\x07 |" in text and "| a\\|b\\nc |" in text and "| rtl\\u202e |" in text
    assert "(\\x1b[31mevicted)" in text and "expired_evicted by the store's reason: \\x1b[31mevicted 4" in text
    table = text[text.index("\n| session |") + 1:].splitlines()
    cells = {len(re.split(r"(?<!\\)\|", ln)) for ln in table if ln.startswith("|")}
    assert len(table) == 2 + len(evil) and cells == {11}  # every row of the sessions table: its 9 cells


# -- through a real vLLM engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("vllm")
    from kvstore.bench.common.tiny_model import build_tiny_llama

    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")), hidden=256, layers=4, seed=0)


@pytest.mark.vllm
def test_each_cache_busting_pattern_through_the_connector(tiny_model, tmp_path):
    """Sessions (each named by the kvstore.session hint, and a tenant of its own: one cache_salt
    each) through the real connector, then ``kvstore explain`` on the
    trace it wrote: append-only (and an exact replay), a timestamp at the top, an edited middle
    turn, and a session whose blocks were evicted between its turns (DRAM of 32 blocks, no NVMe;
    a 48-block prompt of another session in between). vLLM's own prefix cache is reset after every
    request, so what a turn got came from kvstore. The served tokens split into replay and
    genuine exactly."""
    from conftest import prompt
    from test_vllm_connector import Engine

    from kvstore.offload import readout as stats

    trace = tmp_path / "trace.jsonl"
    block = 128 * 1024  # 4 layers x K,V x 2 heads x 64 x 32 tokens x fp32
    e = Engine(tiny_model, str(tmp_path / "s"), dram_gb=32 * block / 2**30, nvme_gb=0,
               extra={"trace_path": str(trace), "trace_tokens": True})
    from vllm import SamplingParams

    def turn(session: str, p: list[int]) -> list[int]:
        out = e.llm.generate([{"prompt_token_ids": p, "cache_salt": session}],
                             SamplingParams(max_tokens=4, temperature=0,
                                            extra_args={"kv_transfer_params": {"kvstore": {"session": session}}}),
                             use_tqdm=False)
        assert e.llm.reset_prefix_cache()
        return list(out[0].outputs[0].token_ids)

    try:
        system = prompt(64, 1)
        a1 = system + prompt(40, 2)  # 104 tokens
        a2 = a1 + turn("append", a1) + prompt(40, 3)  # 148: shares a1's 3 blocks
        turn("append", a2)  # genuine: 96 tokens served
        turn("append", a2)  # replay: the exact prompt again, 4 blocks (128) served
        h1 = [9, 9, 9, 101, 102, 103, 104, 105] + system + prompt(40, 4)
        h2 = [9, 9, 9, 201, 202, 203, 204, 205] + h1[8:]  # a new timestamp at token 3
        turn("head", h2 + turn("head", h1) + prompt(40, 5))
        r1 = system + prompt(104, 6)  # 168 tokens: 5 full blocks
        r2 = list(r1)
        r2[100] = 7 if r2[100] != 7 else 8  # an earlier turn edited at token 100 (block 3)
        turn("rewrite", r2 + turn("rewrite", r1) + prompt(40, 7))  # genuine: 96 served
        e1 = system + prompt(40, 8)
        e2 = e1 + turn("evict", e1) + prompt(40, 9)
        turn("flood", prompt(48 * 32, 10))  # 48 blocks through a 32-block DRAM: evicts every block
        turn("evict", e2)
        reg = e.shared.metrics.registry
        kind = {k: reg.get_sample_value("kvstore_engine_served_tokens_by_kind_total", {"tier": "dram", "kind": k})
                for k in ("replay", "genuine")}
        served = reg.get_sample_value("kvstore_engine_served_tokens_total", {"tier": "dram"})
        summary = e.shared.metrics.summary()
    finally:
        e.close()
    assert kind == {"replay": 128, "genuine": 96 + 96} and served == 128 + 192
    assert summary["served_tokens_by_kind"]["replay"]["dram"] == 128
    assert summary["hit_rate_by_kind"]["replay"] + summary["hit_rate_by_kind"]["genuine"] == pytest.approx(
        summary["hit_rate"])
    assert "replay " in "\n".join(stats.render_engine(summary))

    recs = list(read_trace(trace))
    assert all(r.tokens is not None and len(r.tokens) == r.prompt_tokens for r in recs)
    assert [r.replay for r in recs if r.session == "append"] == [False, False, True]
    r = explain_file(trace, examples=5)
    by_session: dict[str, list[str]] = {}
    ex = Explainer()
    turns = [ex.add(x) for x in sorted(recs, key=lambda x: x.t)]
    for tn in turns:
        by_session.setdefault(tn.session, []).append(tn.cls)
    assert by_session == {"append": [FIRST, APPEND, APPEND], "head": [FIRST, HEAD], "rewrite": [FIRST, REWRITE],
                          "evict": [FIRST, LOST], "flood": [FIRST]}
    head = next(t for t in turns if t.cls == HEAD)
    rewrite = next(t for t in turns if t.cls == REWRITE)
    lost = next(t for t in turns if t.cls == LOST)
    assert (head.diverged_block, head.diverged_token) == (0, 3)
    assert (rewrite.diverged_block, rewrite.diverged_token, rewrite.lost_tokens) == (3, 100, 2 * 32)
    assert (lost.reason, lost.got_blocks, lost.want_blocks) == ("evicted", 0, 3)
    assert r["classes"][HEAD]["turns"] == r["classes"][REWRITE]["turns"] == r["classes"][LOST]["turns"] == 1
    assert r["tokens_recorded"] and r["hits_recorded"] and r["replay_requests"] == 1
    assert os.path.getsize(trace) > 0
