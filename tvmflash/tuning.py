"""Tuned knob values per target and spec, read from `tuning_logs/<target>/knobs.json`.

The file maps a spec name (AttentionSpec.name) to knob values (see schedules/host.py for the
knob names); a spec without an entry uses the schedule's defaults (on CPUs, first the entry of
the plain spec with the same dtype and head dim; so do CUDA kv_cache specs).
"""
from __future__ import annotations

import json
from functools import lru_cache

from ._paths import TUNING_LOGS_DIR
from .spec import AttentionSpec


@lru_cache(maxsize=None)
def _records(target_kind: str) -> dict:
    path = TUNING_LOGS_DIR / target_kind / "knobs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def tuned_knobs(target_kind: str, spec: AttentionSpec) -> dict:
    """The record of `spec`; on CPUs a spec without one (causal, masked) takes the record of
    the plain spec with its dtype and head dim (same kernels, same tile shapes)."""
    records = _records(target_kind)
    if spec.name not in records and (target_kind != "cuda" or spec.kv_cache):
        # (CUDA decode kernels: their tiles do not depend on causal or the variants either)
        return dict(records.get(AttentionSpec(spec.dtype, spec.head_dim, kv_cache=spec.kv_cache).name, {}))
    return dict(records.get(spec.name, {}))
