"""Tuning records: `tuning_logs/<target>/` is a MetaSchedule JSON database, read by every build.

One workload per (spec, phase): a stub PrimFunc whose attributes name them (`tvmflash.spec`,
`tvmflash.phase`; phases `forward`, `backward`, `decode`, `decode_long` tune disjoint knobs).
A tuning record's trace is the knob choice written as MetaSchedule instructions: per knob, a `sample_categorical`
over the knob's candidate values (its decision is the chosen one) whose result annotates the
root block under the knob's name; run_secs is the candidate's measured time. So
`ms.database.JSONDatabase(work_dir=...)` opens the files, `get_top_k` ranks the candidates and
applying a record's trace shows its knobs as block annotations. The kernels themselves are
generated from the knob values (TIRx native kernels, which a schedule trace cannot describe).

Reading and merging here are plain JSON (no TVM): a deployment with only TVM's runtime computes
module keys from these records too. Writing new workloads and traces needs TVM's compiler
(`tvmflash.tune`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ._paths import TUNING_LOGS_DIR
from .spec import AttentionSpec

WORKLOADS, RECORDS = "database_workload.json", "database_tuning_record.json"
SPEC_KEY, PHASE_KEY = "tvmflash.spec", "tvmflash.phase"  # root-block annotations of every trace
# a kv_cache spec's CUDA module holds one decode kernel per decode phase, each with its own knobs
# (`<phase>_*`): `decode` for caches in pages of fewer than ops.DECODE_LONG_PAGE keys,
# `decode_long` for longer pages and contiguous caches (schedules/cuda_decode.py)
DECODE_PHASES = ("decode", "decode_long")
PHASES = ("forward", "backward", *DECODE_PHASES)
FAILED_SECS = 1e10  # MetaSchedule's run_secs of a candidate that failed to build or run


@dataclass(frozen=True)
class Record:
    """One decoded line of database_tuning_record.json."""
    workload: int  # line index in database_workload.json
    spec: str
    phase: str
    knobs: dict
    run_secs: tuple | None  # None: not measured (kept, ranked after every measured record)
    line: list  # the line as MetaSchedule wrote it

    @property
    def secs(self) -> float:
        """Mean run time; unmeasured or failed records rank last."""
        return sum(self.run_secs) / len(self.run_secs) if self.run_secs else FAILED_SECS

    @property
    def valid(self) -> bool:
        return self.secs < FAILED_SECS


def decode_trace(trace: list) -> tuple[dict, dict]:
    """(knob values, string annotations) of a trace in MetaSchedule's JSON form
    [[instructions], [[instruction index, decision], ...]]."""
    instructions, decisions = trace
    decided = {index: decision for index, decision in decisions}
    values, knobs, strings = {}, {}, {}
    for index, (kind, inputs, attrs, outputs) in enumerate(instructions):
        if kind == "SampleCategorical":
            candidates = attrs[0]
            values[outputs[0]] = candidates[decided[index]]
        elif kind == "Annotate":
            value = inputs[1]
            if value in values:
                knobs[attrs[0]] = values[value]
            else:  # literals are JSON-encoded: strings keep their quotes
                strings[attrs[0]] = json.loads(value)
    return knobs, strings


class Database:
    """A MetaSchedule JSON database directory (`database_workload.json` +
    `database_tuning_record.json`), read and appended without TVM."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.workloads = _lines(self.directory / WORKLOADS)
        self.records = [_decode(line) for line in _lines(self.directory / RECORDS)]

    def workload_index(self, workload_line: list) -> int:
        """The index of a workload line (by structural hash), appended if new."""
        for index, (shash, _) in enumerate(self.workloads):
            if shash == workload_line[0]:
                return index
        self.workloads.append(workload_line)
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / WORKLOADS, "a") as f:
            f.write(json.dumps(workload_line) + "\n")
        return len(self.workloads) - 1

    def add(self, workload_line: list, trace: list, run_secs: list | None, target: dict) -> Record:
        """Append a measurement (MetaSchedule's record line: workload index, [trace, run_secs,
        target, args_info])."""
        line = [self.workload_index(workload_line), [trace, run_secs, target, None]]
        with open(self.directory / RECORDS, "a") as f:
            f.write(json.dumps(line) + "\n")
        record = _decode(line)
        self.records.append(record)
        return record

    def best(self) -> dict:
        """(spec, phase) -> its fastest record (an unmeasured one only where nothing ran)."""
        out: dict = {}
        for r in self.records:
            key = (r.spec, r.phase)
            if key not in out or r.secs < out[key].secs:
                out[key] = r
        return out

    def knobs(self, spec_name: str) -> dict | None:
        """The knobs of `spec_name`'s best record of every phase, or None without any."""
        best = self.best()
        found = [best[(spec_name, p)].knobs for p in PHASES if (spec_name, p) in best]
        return {k: v for knobs in found for k, v in knobs.items()} if found else None

    def merge_into(self, directory: Path, retimed: dict | None = None) -> list[tuple[Record, Record | None]]:
        """Merge this database's best record per workload into the database at `directory`,
        which then keeps one record per workload, the fastest of both (a tie keeps the old
        one). `retimed`: (spec, phase) -> seconds this run measured for the old record's knobs,
        which its record must beat instead of the old record's own time (taken in another
        session, perhaps of other kernels or on a busier host). Returns (new best, replaced
        record or None) for each workload that changed."""
        old = Database(directory)
        kept = {key: (record, old) for key, record in old.best().items()}
        bars = {key: (retimed or {}).get(key, record.secs) for key, (record, _) in kept.items()}
        changed = []
        for key, record in self.best().items():
            if record.valid and (key not in kept or record.secs < bars[key]):
                changed.append((record, kept[key][0] if key in kept else None))
                kept[key] = (record, self)
        workloads, lines = [], []
        for key in sorted(kept):
            record, db = kept[key]
            workloads.append(db.workloads[record.workload])
            lines.append([len(workloads) - 1, record.line[1]])
        directory.mkdir(parents=True, exist_ok=True)
        _write_lines(directory / WORKLOADS, workloads)
        _write_lines(directory / RECORDS, lines)
        return changed


def _lines(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_lines(path: Path, lines: list) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(path)


def _decode(line: list) -> Record:
    workload, (trace, run_secs, _target, _args) = line
    knobs, strings = decode_trace(trace)
    return Record(workload, strings.get(SPEC_KEY, ""), strings.get(PHASE_KEY, "forward"), knobs,
                  tuple(run_secs) if run_secs else None, line)


@lru_cache(maxsize=None)
def _shipped(target_kind: str) -> Database:
    return Database(TUNING_LOGS_DIR / target_kind)


def tuned_knobs(target_kind: str, spec: AttentionSpec) -> dict:
    """The recorded knobs of `spec` (its best record per phase), layered: on CPUs the plain
    spec's of its dtype and head dim (masks and variants keep the same kernels and tiles), over
    them the bottom-right causal spec's if `spec` is causal (causal calls skip and mask other
    blocks and favour shorter kv blocks, so their forward is tuned apart), over them its own.
    kv_cache specs on CUDA layer the plain kv_cache spec's under their own (their decode tiles
    depend on neither causal nor the variants); other CUDA specs take only their own."""
    db = _shipped(target_kind)
    if target_kind == "cuda" and not spec.kv_cache:
        return dict(db.knobs(spec.name) or {})
    chain = [AttentionSpec(spec.dtype, spec.head_dim, kv_cache=spec.kv_cache)]
    if spec.causal != "none" and target_kind != "cuda":
        chain.append(AttentionSpec(spec.dtype, spec.head_dim, causal="bottom_right", kv_cache=spec.kv_cache))
    knobs: dict = {}
    for name in dict.fromkeys([*(s.name for s in chain), spec.name]):  # the most specific last
        knobs.update(db.knobs(name) or {})
    return knobs


def tuned_spec_names(target_kind: str) -> list[str]:
    """The specs that have records for `target_kind`."""
    return sorted({spec for spec, _ in _shipped(target_kind).best()})
