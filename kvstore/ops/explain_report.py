"""Rendering of ``kvstore explain``'s report (kvstore.ops.explain): Markdown text and a PNG plot.

A session, a reason or a path comes from the trace (an API client's session id, through the
connector): each is printed escaped, ``|`` too in a table cell (kvstore.ops.printable), and
its ``$`` escaped in the plot (matplotlib reads ``$...$`` as math: a bad one stopped the plot).
"""

from __future__ import annotations

from kvstore.ops.explain import APPEND, CLASSES, FIRST, HEAD, LOST, PROBLEMS, REWRITE, UNKNOWN
from kvstore.ops.printable import cell, printable

MEANS = {
    FIRST: "a session's first request (nothing to compare)",
    APPEND: "appended to the previous turn and got its blocks: healthy",
    HEAD: "changed at the top (block 0-1): a timestamp or id first? put it last",
    REWRITE: "diverged before the end of the previous prompt: history edited, append instead",
    LOST: "append-only but the blocks were gone: it would have hit (TTL, capacity: kvstore tune)",
    UNKNOWN: "append-only; whether it got its blocks is unknown (the trace has no hit_tokens)",
}
COLORS = {FIRST: "#bbbbbb", APPEND: "#4c9a2a", HEAD: "#d1495b", REWRITE: "#edae49", LOST: "#00798c",
          UNKNOWN: "#9e9ac8"}
FIELD_SOURCE = "The vLLM connector writes them (trace_path); a synthetic trace (bench agent --trace-out) has none"


def _where(ex: dict) -> str:
    if "diverged_token" in ex:
        return f"token {ex['diverged_token']}"
    if "diverged_tokens" in ex:
        lo, hi = ex["diverged_tokens"]
        return f"block {ex['diverged_block']} (tokens {lo}-{hi - 1})"
    return f"got {ex.get('got_blocks', '?')} of {ex['want_blocks']} blocks ({cell(ex.get('reason', '?'))})"


def render(r: dict) -> str:
    unknown = r["classes"][UNKNOWN]["turns"]
    if not unknown:
        lost = f"{r['lost_tokens']} reusable tokens lost"
    elif r["lost_tokens"]:
        lost = f"at least {r['lost_tokens']} reusable tokens lost ({unknown} append-only turns unknown)"
    else:
        lost = f"reusable tokens lost: unknown ({unknown} append-only turns do not record what they got)"
    out = [f"kvstore explain{' ' + printable(r['trace']) if 'trace' in r else ''}: {r['requests']} requests, "
           f"{r['sessions']} sessions ({r['single_request_sessions']} with one request), block "
           f"{r['block_tokens']} tokens, {r['followup_turns']} follow-up turns; {lost}", ""]
    if r.get("fields_missing"):
        out += ["Not in this trace: " + ", ".join(f"{k} ({n} of {r['requests']} requests)"
                                                  for k, n in r["fields_missing"].items())
                + f". {FIELD_SOURCE}.", ""]
    out += ["| class | turns | of follow-ups | lost tokens | means |", "|---|---|---|---|---|"]
    no_hits = r["followups_with_hits"] == 0 and r["followup_turns"] > 0
    for c in CLASSES:
        d = r["classes"][c]
        if c == UNKNOWN and not d["turns"]:
            continue
        share = "" if d["share_of_followups"] is None else f"{d['share_of_followups']:.1%}"
        turns, lost_c = d["turns"], "unknown" if d["lost_tokens"] is None else d["lost_tokens"]
        if no_hits and c in (APPEND, LOST):  # nothing recorded to tell them apart: unknown, not 0
            turns = share = lost_c = "unknown"
        out.append(f"| {c} | {turns} | {share} | {lost_c} | {MEANS[c]} |")
    notes = []
    if not r["hits_recorded"]:
        notes.append(f"only {r['followups_with_hits']} of {r['followup_turns']} follow-up turns record what they "
                     f"got (hit_tokens): the {unknown} append-only turns without it are {UNKNOWN}, neither healthy "
                     "nor expired/evicted; what they lost is unknown")
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
                + ", ".join(f"{printable(k, 64)} {v}" for k, v in r["expired_evicted_reasons"].items())]
    if any(r["examples"][c] for c in PROBLEMS):
        out += ["", "Examples (largest losses first):", "", "| class | session | turn | t | where | lost tokens |",
                "|---|---|---|---|---|---|"]
        for c in PROBLEMS:
            for ex in r["examples"][c]:
                out.append(f"| {c} | {cell(ex['session'])} | {ex['turn']} | {ex['t']:.3f} | {_where(ex)} | "
                           f"{ex['lost_tokens']} |")
                if "context" in ex:
                    cx = ex["context"]
                    out.append(f"|  | | | | from token {cx['from']}: previous {cx['previous']}, this {cx['this']} | |")
                elif "note" in ex:
                    out.append(f"|  | | | | {cell(ex['note'], None)} | |")
    if r["sessions_top"]:
        out += ["", f"Sessions by lost tokens (top {len(r['sessions_top'])}):", "",
                "| session | turns | " + " | ".join(CLASSES) + " | lost tokens |",
                "|---|---|" + "---|" * len(CLASSES) + "---|"]
        for s in r["sessions_top"]:
            lost_s = f"{s['lost_tokens']} + unknown" if s[UNKNOWN] else str(s["lost_tokens"])
            out.append(f"| {cell(s['session'])} | {s['turns']} | " + " | ".join(str(s[c]) for c in CLASSES)
                       + f" | {lost_s} |")
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    """Left: classes per session (the sessions losing most); right: where turns diverged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ss = r["sessions_top"]
    names = [printable(s["session"], 16).replace("$", r"\$") for s in ss]
    left = [0] * len(ss)
    for c in CLASSES:
        vals = [s[c] for s in ss]
        a.barh(names, vals, left=left, color=COLORS[c], label=c)
        left = [x + y for x, y in zip(left, vals)]
    a.invert_yaxis()
    a.set_xlabel("turns")
    a.set_title(f"turns per session, by class ({len(ss)} sessions losing most on top)")
    a.xaxis.get_major_locator().set_params(integer=True)
    div = {int(k): v for k, v in r["divergence_blocks"].items()}
    if div:
        xs = sorted(div)
        b.bar(xs, [div[x] for x in xs], color=[COLORS[HEAD] if x < 2 else COLORS[REWRITE] for x in xs])
        b.xaxis.get_major_locator().set_params(integer=True)
        b.yaxis.get_major_locator().set_params(integer=True)
    else:
        b.text(0.5, 0.5, f"no turn diverged:\nall {r['followup_turns']} follow-up turns appended to the previous one",
               ha="center", va="center", transform=b.transAxes)
        b.set_xticks([])
        b.set_yticks([])
    b.set_xlabel(f"first differing block (blocks of {r['block_tokens']} tokens)")
    b.set_ylabel("turns")
    b.set_title("where diverging turns diverged (red: head, amber: history)")
    unknown = r["classes"][UNKNOWN]["turns"]
    lost = (f"{r['classes'][LOST]['turns']} expired/evicted" if not unknown else
            f"expired/evicted unknown for {unknown} (no hit_tokens in the trace)")
    fig.suptitle(f"kvstore explain: {r['followup_turns']} follow-up turns, {lost}")
    fig.legend(*a.get_legend_handles_labels(), loc="lower center", ncol=len(CLASSES), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
