"""Rendering of ``kvstore explain``'s report (kvstore.ops.explain): Markdown text and a PNG plot."""

from __future__ import annotations

from kvstore.ops.explain import APPEND, CLASSES, FIRST, HEAD, LOST, PROBLEMS, REWRITE

MEANS = {
    FIRST: "a session's first request (nothing to compare)",
    APPEND: "appended to the previous turn and got its blocks: healthy",
    HEAD: "changed at the top (block 0-1): a timestamp or id first? put it last",
    REWRITE: "diverged before the end of the previous prompt: history edited, append instead",
    LOST: "append-only but the blocks were gone: it would have hit (TTL, capacity: kvstore tune)",
}
COLORS = {FIRST: "#bbbbbb", APPEND: "#4c9a2a", HEAD: "#d1495b", REWRITE: "#edae49", LOST: "#00798c"}


def _where(ex: dict) -> str:
    if "diverged_token" in ex:
        return f"token {ex['diverged_token']}"
    if "diverged_tokens" in ex:
        lo, hi = ex["diverged_tokens"]
        return f"block {ex['diverged_block']} (tokens {lo}-{hi - 1})"
    return f"got {ex.get('got_blocks', '?')} of {ex['want_blocks']} blocks ({ex.get('reason', '?')})"


def render(r: dict) -> str:
    out = [f"kvstore explain{' ' + r['trace'] if 'trace' in r else ''}: {r['requests']} requests, "
           f"{r['sessions']} sessions ({r['single_request_sessions']} with one request), block "
           f"{r['block_tokens']} tokens, {r['followup_turns']} follow-up turns, "
           f"{r['lost_tokens']} reusable tokens lost", ""]
    out += ["| class | turns | of follow-ups | lost tokens | means |", "|---|---|---|---|---|"]
    for c in CLASSES:
        d = r["classes"][c]
        share = "" if d["share_of_followups"] is None else f"{d['share_of_followups']:.1%}"
        out.append(f"| {c} | {d['turns']} | {share} | {d['lost_tokens']} | {MEANS[c]} |")
    notes = []
    if not r["hits_recorded"]:
        notes.append(f"only {r['followups_with_hits']} of {r['followup_turns']} follow-up turns record what "
                     "they got (hit_tokens): expired or evicted turns without it count as append_only")
    if r["sessions"] and r["single_request_sessions"] == r["sessions"] and r["requests"] > 1:
        notes.append("every session has one request: the connector names a session by the request's "
                     "cache_salt; send one per conversation to compare its turns")
    if not r["tokens_recorded"]:
        notes.append("not every request has its token ids in the trace: there, divergence is given per block "
                     "(trace_tokens: true gives the first differing token)")
    if r["replay_requests"] is not None:
        notes.append(f"{r['replay_requests']} of {r['requests']} requests were replays (the exact prompt again)")
    out += [""] + [f"* {n}" for n in notes]
    if r["expired_evicted_reasons"]:
        out += ["", "expired_evicted by the store's reason: "
                + ", ".join(f"{k} {v}" for k, v in r["expired_evicted_reasons"].items())]
    if any(r["examples"][c] for c in PROBLEMS):
        out += ["", "Examples (largest losses first):", "", "| class | session | turn | t | where | lost tokens |",
                "|---|---|---|---|---|---|"]
        for c in PROBLEMS:
            for ex in r["examples"][c]:
                out.append(f"| {c} | {ex['session']} | {ex['turn']} | {ex['t']:.3f} | {_where(ex)} | "
                           f"{ex['lost_tokens']} |")
                if "context" in ex:
                    cx = ex["context"]
                    out.append(f"|  | | | | from token {cx['from']}: previous {cx['previous']}, this {cx['this']} | |")
                elif "note" in ex:
                    out.append(f"|  | | | | {ex['note']} | |")
    if r["sessions_top"]:
        out += ["", f"Sessions by lost tokens (top {len(r['sessions_top'])}):", "",
                "| session | turns | " + " | ".join(CLASSES) + " | lost tokens |",
                "|---|---|" + "---|" * len(CLASSES) + "---|"]
        for s in r["sessions_top"]:
            out.append(f"| {s['session']} | {s['turns']} | " + " | ".join(str(s[c]) for c in CLASSES)
                       + f" | {s['lost_tokens']} |")
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    """Left: classes per session (the sessions losing most); right: where turns diverged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ss = r["sessions_top"]
    names = [s["session"][:16] for s in ss]
    left = [0] * len(ss)
    for c in CLASSES:
        vals = [s[c] for s in ss]
        a.barh(names, vals, left=left, color=COLORS[c], label=c)
        left = [x + y for x, y in zip(left, vals)]
    a.invert_yaxis()
    a.set_xlabel("turns")
    a.set_title("turns per session, by class (most lost tokens on top)")
    a.xaxis.get_major_locator().set_params(integer=True)
    div = {int(k): v for k, v in r["divergence_blocks"].items()}
    if div:
        xs = sorted(div)
        b.bar(xs, [div[x] for x in xs], color=[COLORS[HEAD] if x < 2 else COLORS[REWRITE] for x in xs])
    b.set_xlabel(f"first differing block (x {r['block_tokens']} tokens)")
    b.set_ylabel("turns")
    b.xaxis.get_major_locator().set_params(integer=True)
    b.yaxis.get_major_locator().set_params(integer=True)
    b.set_title("where diverging turns diverged (red: head, amber: history)")
    lost = r["classes"][LOST]["turns"]
    fig.suptitle(f"kvstore explain: {r['followup_turns']} follow-up turns, {lost} expired/evicted")
    fig.legend(*a.get_legend_handles_labels(), loc="lower center", ncol=len(CLASSES), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
