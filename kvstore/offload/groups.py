"""The KV cache groups of a model, and what a prefix hit needs from each. Rules only: no I/O.

vLLM's hybrid KV cache manager gives each kind of layer its own group, with its own block
table over one shared pool of blocks (every group's block has the same page size; a group holds
the same number of layers, or fewer when vLLM pads it). For a hit of ``k`` blocks (``k *
block_size`` tokens) where the engine already holds the first ``skip`` blocks, a group needs:

* ``FULL`` (full attention, MLA): every block in ``[skip, k)``;
* ``WINDOW`` (sliding window of ``w`` tokens, ``e`` retained below it; chunked local attention
  of chunk ``C``): the blocks the window of the next token covers, ``[first_needed(k), k)``,
  with ``first_needed(k) = (k*bs - w + 1 - e) // bs`` (sliding) or ``(k*bs // C) * C // bs``
  (chunked): vLLM allocates null blocks below that (``get_num_skipped_tokens``);
* ``STATE`` (Mamba, linear attention, short conv in vLLM's "align" mode): the state after the
  hit's last block, one block at index ``k - 1``.

What a group stores, so that later hits find it and a sliding-window layer costs only its
window: ``FULL`` every full block; ``WINDOW`` the blocks a hit needs at the prompt's last
offerable boundary and after it (decode blocks: a later turn's hit ends there), and at the point
where a lookup found a stored prefix ending (a junction shared with another prompt, as vLLM's
own cache keeps); ``STATE`` the states vLLM hands off (``boundary_state_offloads``: the state
at the prompt's last block boundary before its last token, measured on vLLM 0.32).

A hit is offered only where every group can supply it: :meth:`KVGroups.hit` shortens it group
by group until all agree (vLLM's own hybrid lookup is the same fixed point).

Keys. A single full-attention group keeps the plain chain keys (stores written before hybrid
support stay valid). Otherwise every group's key is ``H(chain key || group tag)``, the tag
carrying the group's index, kind and window, so one token prefix names one block per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.keys import derive_keys, encode

FULL, WINDOW, STATE = "full", "window", "state"

# vLLM's KVCacheSpecKind values -> how kvstore treats them (others are not supported: the
# connector logs it once and stores nothing for that model)
ROLES = {"full_attention": FULL, "mla_attention": FULL, "sliding_window": WINDOW,
         "sliding_window_mla": WINDOW, "chunked_local_attention": WINDOW, "mamba": STATE}

# Contains-prefix calls one lookup may make for the window and state groups (each one a round
# trip to the store when it is in another process); a hit not settled by then is not offered.
MAX_PROBES = 8


@dataclass(frozen=True)
class Group:
    index: int
    kind: str  # vLLM's KVCacheSpecKind value
    block_size: int
    window: int = 0  # tokens: sliding window + retained tokens; chunked local: the chunk size
    layers: int = 1

    @property
    def role(self) -> str:
        return ROLES[self.kind]

    @property
    def chunked(self) -> bool:
        return self.kind == "chunked_local_attention"

    def first_needed(self, k: int) -> int:
        """The first block a hit of ``k`` blocks needs from this group."""
        role = self.role
        if role == FULL:
            return 0
        if role == STATE:
            return max(0, k - 1)
        t = k * self.block_size
        start = t // self.window * self.window if self.chunked else max(0, t - self.window + 1)
        return start // self.block_size

    def needed(self, k: int, skip: int = 0) -> range:
        return range(max(skip, self.first_needed(k)), k)

    def retreat(self, k: int, missing: int) -> int:
        """The next boundary to try when block ``missing`` was needed for ``k`` but is not stored."""
        return missing if self.role == WINDOW else k - 1

    def tag(self) -> bytes:
        return encode(("kv-group", self.index, self.kind, self.window))


class KVGroups:
    """A model's groups (in vLLM's order) and their rules."""

    def __init__(self, groups: Sequence[Group]):
        if not groups:
            raise ValueError("a model has at least one KV cache group")
        self.groups = tuple(groups)
        sizes = {g.block_size for g in self.groups}
        if len(sizes) != 1:
            raise ValueError(f"KV cache groups with different block sizes {sorted(sizes)}")
        self.block_size = sizes.pop()
        self.plain = len(self.groups) == 1 and self.groups[0].role == FULL  # the chain keys as they are
        self.full = [g for g in self.groups if g.role == FULL]
        self.partial = [g for g in self.groups if g.role != FULL]  # window and state groups
        self.table = [g for g in self.groups if g.role != STATE]  # stored from the block tables
        self.state = [g for g in self.groups if g.role == STATE]  # stored from vLLM's hand-offs
        self._tags = [g.tag() for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)

    def describe(self) -> tuple:
        """For the model fingerprint: every group's kind, window and layer count."""
        return tuple((g.kind, g.window, g.layers) for g in self.groups)

    def keys(self, g: int, base: Sequence[bytes]) -> list[bytes]:
        """Group ``g``'s keys of the blocks whose chain keys are ``base``."""
        return list(base) if self.plain else derive_keys(base, self._tags[g])

    def keeps(self, g: Group, i: int, last: int, junction: int) -> bool:
        """Whether table group ``g`` stores block ``i`` of a request whose last offerable
        boundary is ``last`` blocks and whose lookup found a stored prefix of ``junction``."""
        if g.role == FULL or i >= g.first_needed(last):
            return True
        return 0 < junction and g.first_needed(junction) <= i < junction

    def loads(self, tables, first: int, k: int) -> list[tuple[int, int, int]] | None:
        """(group, block index, engine block) of every block a hit of blocks ``[first, k)``
        fills: the non-null blocks vLLM allocated for it in each group (it allocates none where
        a group needs nothing). None when the tables do not cover the hit."""
        if tables is None or len(tables) != len(self.groups):
            return None
        out = []
        for g in self.groups:
            t = tables[g.index]
            if len(t) < k:
                return None
            out += [(g.index, i, t[i]) for i in range(first, k) if t[i]]
        return out

    def stores(self, tables, start: int, full: int, last: int, junction: int) -> list[tuple[int, int, int]]:
        """(group, block index, engine block) of the blocks ``[start, full)`` the table groups
        keep (:meth:`keeps`), where vLLM holds them (not its null block)."""
        out = []
        for g in self.table:
            t = tables[g.index] if g.index < len(tables) else ()
            out += [(g.index, i, t[i]) for i in range(start, min(full, len(t)))
                    if t[i] and self.keeps(g, i, last, junction)]
        return out

    def states(self, handed: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """(group, block index, engine block) of the states vLLM handed off (``(group, engine
        block, boundary tokens)``): the state after block ``tokens // block_size - 1``, on a
        block boundary, in a state group, never vLLM's null block."""
        bs, n = self.block_size, len(self.groups)
        return [(g, t // bs - 1, b) for g, b, t in handed
                if b and t >= bs and t % bs == 0 and 0 <= g < n and self.groups[g].role == STATE]

    def hit(self, k: int, skip: int, probe: Callable[[Group, list[int]], tuple[int, str | None]]
            ) -> tuple[int, int, str | None]:
        """The longest hit of at most ``k`` blocks every window and state group can supply:
        ``(blocks, probes made, miss reason or None)``. ``probe(group, positions)`` returns how
        many of ``positions``, last first, are stored and why the next one is not (one
        contains-prefix call)."""
        probes, reason = 0, None
        while k > skip:
            shorter = None
            for g in self.partial:
                need = list(g.needed(k, skip))
                if not need:
                    continue
                if probes >= MAX_PROBES:
                    return skip, probes, reason or "never_stored"
                have, why = probe(g, need)
                probes += 1
                if have < len(need):
                    shorter = g.retreat(k, need[len(need) - 1 - have])
                    reason = why or "never_stored"
                    break
            if shorter is None:
                return k, probes, reason
            k = shorter
        return skip, probes, reason
