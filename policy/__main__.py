"""`python -m policy`: the rules at work on a 3-turn conversation (3,000 / 4,100 / 9,000 rows).

Prints each turn's fresh plan, the row it resumes from, the rows it keeps and the tail,
then what the warm pass after its reply keeps. Pure functions and the store, no clock.
"""

from __future__ import annotations

from policy.config import PolicyConfig
from policy.keep import PassKind, keep_rows
from policy.plan import fresh_cuts, plan_chunks
from policy.prefix import Prompt
from policy.shape import QWEN35_27B, state_bytes
from policy.store import Store
from policy.tail import TailFacts, tail_from
from policy.usable import BackendFacts, cut_fingerprint
from policy.warm import decide_warm

# (content id, rows) pieces of each turn's prompt; each turn extends the one before it.
TURNS = [
    [(1, 1200), (2, 1797), (-3, 3)],                     # system, user, generation prompt
    [(1, 1200), (2, 1797), (-3, 3), (3, 400), (4, 697), (-3, 3)],  # + reply, + user
    [(1, 1200), (2, 1797), (-3, 3), (3, 400), (4, 697), (-3, 3), (5, 2000), (6, 2897), (-3, 3)],
]
STARTS = [(0, 1200), (0, 1200, 2997, 3397), (0, 1200, 2997, 3397, 4097, 6097)]


def _show(title: str, values: object) -> None:
    print(f"  {title:<22}{values}")


def main() -> None:
    """Print the demo (see the module docstring)."""
    cfg = PolicyConfig()
    facts = BackendFacts(None)
    store = Store(QWEN35_27B, cfg, facts)
    tail = TailFacts(tail_rows=cfg.tail_rows)
    print(f"policy: grid_rows={cfg.grid_rows} request_starts={cfg.request_starts} "
          f"max_chunk_rows={cfg.max_chunk_rows} tail_rows={cfg.tail_rows}; invariant_rows=None")
    for k, (pieces, starts) in enumerate(zip(TURNS, STARTS), start=1):
        prompt = Prompt.synthetic(pieces)
        rows = len(prompt)
        print(f"\nturn {k}: {rows} rows, request starts {starts}")
        _show("fresh cuts", fresh_cuts(rows, starts, cfg))
        entry = store.lookup(prompt, starts, now_s=float(k))
        resume = entry.row if entry else 0
        _show("resumes at", f"row {resume} (cached_tokens)")
        chunks = plan_chunks(rows, starts, resume, cfg)
        _show("chunks", [(c.start, c.end) for c in chunks])
        _show("tail", [tail_from(c, tail) for c in chunks])
        cuts = fresh_cuts(rows, starts, cfg)
        kept = []
        for keep in keep_rows(PassKind.COLD, rows, starts, resume, cfg, facts):
            fp = cut_fingerprint(cuts, keep.row, facts)
            res = store.keep(prompt, keep.row, fp, has_logits=keep.with_logits, value_s=keep.row * 1e-4,
                             now_s=float(k))
            kept.append(f"{keep.row}{' +logits' if keep.with_logits else ''}")
            assert res.entry is not None
        _show("keeps", ", ".join(kept) or "nothing")
        if k < len(TURNS):
            nxt = Prompt.synthetic(TURNS[k])
            end = STARTS[k][-1]
            cont, cont_starts = nxt.prefix(end), tuple(s for s in STARTS[k] if s < end)
            w_entry = store.lookup(cont, cont_starts, now_s=float(k))
            w_resume = w_entry.row if w_entry else 0
            decision = decide_warm(end, cont_starts, w_resume, cfg, facts,
                                   [e.row for e in store.entries() if e.live])
            _show("warm pass", f"{decision.verdict.value} rows [{w_resume}, {decision.end_row}), keeps "
                  f"{[r.row for r in decision.keeps]} ({decision.reason})")
            for keep in decision.keeps:
                fp = cut_fingerprint(fresh_cuts(end, cont_starts, cfg), keep.row, facts)
                store.keep(cont, keep.row, fp, has_logits=False, value_s=keep.row * 1e-4, now_s=float(k))
    print(f"\nstore: {len(store)} states, {store.bytes_used / 2**30:.2f} GiB "
          f"(27B: {state_bytes(QWEN35_27B, 0) / 2**20:.0f} MiB fixed + {QWEN35_27B.row_bytes // 1024} KiB/row)")


if __name__ == "__main__":
    main()
