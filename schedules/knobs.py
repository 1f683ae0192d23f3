"""Named tunable decisions, recorded in the schedule trace the MetaSchedule way.

A schedule function asks `Knobs` for each choice; with fixed values (the template defaults or a
tuning record) the decision is pinned, with `fixed=None` it is sampled (MetaSchedule tuning
explores it and its mutators can change it). Either way the decision is a `sample_categorical`
/ `sample_perfect_tile` instruction in the trace, so a tuned trace replays exactly.
"""
from __future__ import annotations


class Knobs:
    def __init__(self, sch, fixed: dict | None, prefix: str = ""):
        self.sch = sch
        self.fixed = fixed
        self.prefix = prefix
        self.chosen: dict = {}

    def categorical(self, name: str, candidates: list[int], default: int):
        name = self.prefix + name
        if default not in candidates:
            default = candidates[0]
        decision = None
        if self.fixed is not None:
            value = self.fixed.get(name, default)
            decision = candidates.index(value if value in candidates else default)
        rv = self.sch.sample_categorical(candidates, [1.0 / len(candidates)] * len(candidates),
                                         decision=decision)
        self.chosen[name] = int(self.sch.get(rv))
        return rv

    def tile(self, name: str, loop, max_innermost: int, default_inner: int):
        """Split `loop` in two; the inner factor is the knob."""
        name = self.prefix + name
        extent = int(self.sch.get(loop).extent)
        decision = None
        if self.fixed is not None:
            inner = self.fixed.get(name, default_inner)
            if extent % inner or inner > max_innermost:
                inner = max(f for f in range(1, max_innermost + 1) if extent % f == 0 and f <= default_inner)
            decision = [extent // inner, inner]
        rvs = self.sch.sample_perfect_tile(loop, n=2, max_innermost_factor=max_innermost, decision=decision)
        self.chosen[name] = int(self.sch.get(rvs[1]))
        return rvs
