"""Knob tuning: search each schedule template's knob grid for a spec on the machine it is for,
keep every measurement in a MetaSchedule JSON database in a work directory, and merge the best
record per workload (spec, phase) into `tuning_logs/<target>/`, which every later build reads
(`tvmflash.tuning`). `tvmflash tune` is the command line.

    tvmflash tune --target cuda --spec bf16:d128:causal --trials 16 --time-budget 600

Candidates are built with TVM's compiler and timed where the target runs: both at once on a
machine that has both (a GPU box with the compiler, a Xeon for `avx512`, any CPU for `host`).
Otherwise the same command builds here (`--build-only`, or simply no GPU / no AVX512) and, run
again on the target machine with the work directory carried over, times what was built there
with TVM's runtime only; run once more here, it merges. A run resumes from its database:
measured candidates are never timed twice, `--trials` counts new measurements per workload.
Before a candidate is timed its results are checked against `tvmflash.reference`
(`check_candidate`); one that differs is recorded as failed.

The forward and the backward have separate knobs and are tuned as separate phases (a
candidate varies one phase's knobs; the others stay at their record). The `decode` and
`decode_long` phases (CUDA kv_cache specs) tune the split-KV decode kernels for short pages
(timed on pages of 16 keys) and for long pages and contiguous caches (pages of 256) with the
launch's CTAs per SM, which sets the automatic num_splits (candidates differing only in it
share a library).

The CUDA kernels are TIRx native kernels generated from Python knobs, so the search is over the
explicit grid of `candidates` (MetaSchedule's own search replays schedule traces, which cannot
describe them); the records are still MetaSchedule's (see `tvmflash.tuning`).
"""
from __future__ import annotations

import itertools
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ._paths import TUNING_LOGS_DIR
from .spec import AttentionSpec
from .tuning import DECODE_PHASES, FAILED_SECS, PHASE_KEY, SPEC_KEY, Database, tuned_knobs

TUNED_SPECS = {
    "cuda": [AttentionSpec(dt, d, causal=c) for dt, d, c in itertools.product(
        ("float16", "bfloat16"), (64, 128), ("none", "top_left", "bottom_right"))],
    "avx512": [AttentionSpec(dt, d) for dt, d in itertools.product(("float32", "bfloat16"), (64, 128))],
    "decode": [AttentionSpec(dt, d, kv_cache=True) for dt, d in itertools.product(("float16", "bfloat16"), (64, 128))],
}
DECODE_CTAS_PER_SM = ((2, 3, 4, 6, 8), (1, 2, 3))  # one-warp CTAs, CTAs of several warps
DECODE_SEQLENS = (8192, 32768)  # B=16, H=32, Hk=8, one query, in shuffled pages of:
DECODE_PAGES = {"decode": 16, "decode_long": 256}
CPU_BLOCKS = [(64, 64), (64, 128), (128, 64), (128, 128), (32, 64), (64, 32), (32, 128), (256, 128), (32, 256), (64, 256),
              (128, 256)]  # (block_q, block_k)
CPU_REGISTER_TILES = [(8, 2), (4, 4), (4, 2)]  # (rows, zmm vectors per row) of the FMA matmuls
AMX_LONG_BLOCK_Q = (128, 256)  # the AMX forward's q-blocks for long keys (timed at SEQLENS[1])
CPU_PHASE_KERNELS = {"forward": ("forward", "forward_long", "forward_pack", "forward_pack_vt"),
                     "backward": ("backward_delta", "backward_fused", "backward_dkdv", "backward_dq", "backward_pack")}
CPU_MATMULS = {"forward": {"forward": ("qk", "pv")},
               "backward": {"backward_fused": ("qk", "dp", "dv", "dk", "dq"),
                            "backward_dkdv": ("qk", "dp", "dv", "dk"), "backward_dq": ("qk", "dp", "dq")}}


def candidates(spec: AttentionSpec, phase: str = "forward", arch: str = "sm_90a") -> list[dict]:
    """The knob grid of `phase`'s kernels for `spec` on `arch`: the wgmma kernels' knobs where
    they take the spec (sm_90a), else the mma.sync kernels'."""
    from .schedules import cuda_backward_wgmma, cuda_forward_wgmma
    from .schedules.cuda_mma import SHARED_LIMIT

    row_bytes = (spec.head_dim + 8) * 2
    out = []
    d = spec.head_dim
    if phase in DECODE_PHASES:  # one-warp CTAs on small tiles, or CTAs of 2-8 warps on 64-128 keys
        from .schedules.cuda_decode import shared_bytes

        shapes = [(1, 16), (1, 32), (1, 64), (2, 64), (2, 128), (4, 64), (4, 128), (8, 128)]  # (warps, block_n)
        return [{f"{phase}_warps": w, f"{phase}_block_n": bn, f"{phase}_stages": st, f"{phase}_l2_prefetch": 0}
                for (w, bn), st in itertools.product(shapes, (2, 3)) if shared_bytes(d, bn, w, st) <= SHARED_LIMIT]
    if phase == "forward" and cuda_forward_wgmma.supports(spec, arch):
        # a softcap's exponents split between MUFU and the FMA pipe (knob of no other spec)
        polys = [{"wgmma_poly_exp2": k} for k in (0, 1, 2)] if "softcap" in spec.variants else [{}]
        # a block mask's tile lists staged in shared memory or read in place (knob of those specs)
        lists = [{"wgmma_stage_lists": k} for k in (0, 1)] if spec.block_sparse else [{}]
        # the warp-specialized loop also persistent, its CTAs drawing their items (block-mask
        # lists are then read in place: one candidate a tile shape)
        drawn = {"wgmma_persistent": 2, "wgmma_uniform_warpgroup": 1}
        for bn, wg, poly, staging in itertools.product((64, 128), (1, 2), polys, lists):
            if (64 * wg + 4 * bn) * d * 2 <= SHARED_LIMIT:  # Q + two K and two V tiles
                knobs = {"forward_wgmma": 1, "wgmma_block_n": bn, "wgmma_warpgroups": wg, **poly}
                out.append({**knobs, **staging})
                specialized = cuda_forward_wgmma.warp_specialized({**cuda_forward_wgmma.default_knobs(spec), **knobs})
                if specialized and staging == lists[0]:
                    out.append({**knobs, **drawn})
    elif phase == "forward":
        for bm, bn, q_regs, mt, st in itertools.product((64, 128), (32, 64, 128), (1, 0), (1, 2), (2, 3)):
            # two m-tiles per warp double the accumulators: only where registers allow
            fits_regs = mt == 1 or (bn <= 64 and (d <= 64 or (d <= 128 and bn == 32 and not q_regs)))
            if (bm + 2 * st * bn) * row_bytes <= SHARED_LIMIT and not (q_regs and d > 128) and fits_regs:
                out.append({"block_m": bm, "block_n": bn, "q_in_registers": q_regs, "warp_m_tiles": mt,
                            "stages": st})
    elif cuda_backward_wgmma.supports(spec, arch):
        out = [{"bwd_wgmma": 1, "bwd_wgmma_warpgroups": wg, "bwd_wgmma_block_m": bm}
               for wg, bm in itertools.product((1, 2), (64, 128))
               if bm == 64 or (d <= 64 and "dropout" not in spec.variants)]  # (dropout: 64, see its schedule)
    else:
        for bn, bm, stages, split in itertools.product((64, 128), (32, 64), (2, 3), (1, 2)):
            # split: two CTAs per kv-block share the gradient columns (for large head dims)
            smem = (2 * bn + 2 * stages * bm) * row_bytes + 2 * bn * (bm + 8) * 2 + stages * bm * 8
            if smem <= SHARED_LIMIT and (split == 1) == (d <= 128):
                out.append({"bwd_block_n": bn, "bwd_block_m": bm, "bwd_stages": stages, "bwd_d_split": split})
    return out


def cpu_candidates(spec: AttentionSpec, phase: str = "forward", kind: str = "avx512") -> list[dict]:
    """The CPU knob grid of `phase`: block sizes, and for the FMA kernels (all but the AMX ones,
    which only `avx512` has) one register tile shape for all of the phase's matmuls (rows x
    vectors of the target's width)."""
    from .schedules.amx_forward import amx_supported

    prefix = "" if phase == "forward" else "bwd_"
    amx = kind == "avx512" and amx_supported(spec)
    tiles = [None] if amx else CPU_REGISTER_TILES
    long_blocks = AMX_LONG_BLOCK_Q if amx and phase == "forward" else [None]
    out = []
    for (bq, bk), tile, long_bq in itertools.product(CPU_BLOCKS, tiles, long_blocks):
        knobs = {f"{prefix}block_q": bq, f"{prefix}block_k": bk}
        if long_bq:
            knobs["long_block_q"] = long_bq
        if tile:
            for kernel, matmuls in CPU_MATMULS[phase].items():
                for m in matmuls:
                    knobs[f"{kernel}.{m}.rows"], knobs[f"{kernel}.{m}.vecs"] = tile
        out.append(knobs)
    return out


TARGET_KINDS = ("cuda", "avx512", "host")
SEQLENS = (1024, 4096)  # a candidate's score: the geometric mean of its times at these lengths
# set at launch, not in the module: candidates share a library
LAUNCH_KNOBS = tuple(f"{phase}_ctas_per_sm" for phase in DECODE_PHASES)


def phases_of(spec: AttentionSpec, kind: str) -> tuple:
    """The tuning phases of `spec` on `kind` (CPU decode kernels have no knobs)."""
    if spec.kv_cache:
        return DECODE_PHASES if kind == "cuda" else ()
    return ("forward", "backward")


def grid(spec: AttentionSpec, phase: str, kind: str) -> list[dict]:
    """Every candidate of `phase` for `spec` on target `kind`."""
    if kind == "cuda":
        found = candidates(spec, phase)
        if phase in DECODE_PHASES:
            found = [{**c, f"{phase}_ctas_per_sm": n} for c in found
                     for n in DECODE_CTAS_PER_SM[c[f"{phase}_warps"] > 1]]
        return found
    return cpu_candidates(spec, phase, kind)


def target_of(kind: str, arch: str | None = None) -> dict:
    """The target dict of `kind` ("cuda" | "avx512" | "host"): CUDA for `arch`, else this
    machine's GPU, else TVMFLASH_CUDA_ARCH / sm_90a."""
    from .build import AVX512_TARGET, cuda_target, cuda_target_for_device, host_target

    if kind == "cuda":
        import torch

        return cuda_target(arch) if arch or not torch.cuda.is_available() else cuda_target_for_device(0)
    return AVX512_TARGET if kind == "avx512" else host_target()


def runs_here(kind: str) -> bool:
    """Whether this machine can time `kind`'s modules."""
    if kind == "cuda":
        import torch

        return torch.cuda.is_available()
    from .cpu import runs_avx512_amx

    return kind == "host" or runs_avx512_amx()


def _tag(knobs: dict) -> str:
    """A file name for a candidate: its knob values in a fixed order (names can be long)."""
    import hashlib

    text = json.dumps(knobs, sort_keys=True)
    return f"{len(knobs)}k-" + hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class Candidate:
    spec: AttentionSpec
    phase: str
    knobs: dict
    baseline: bool = field(default=False, compare=False)  # the knobs the shipped record builds

    @property
    def key(self) -> str:
        return f"{self.spec.name}/{self.phase}/{_tag(self.knobs)}"

    @property
    def lib(self) -> str:
        """Its library in the work directory (shared by candidates that differ in launch knobs)."""
        return f"{self.spec.name}/{_tag({k: v for k, v in self.knobs.items() if k not in LAUNCH_KNOBS})}.so"


def plan(kind: str, specs: list, phases: tuple | None = None, seed: int = 0) -> list[list[Candidate]]:
    """Per workload (spec, phase): its candidates, the one with the knobs a build takes now
    (records over defaults) first as the baseline, the rest in a seeded random order (a
    resumed run continues the same order)."""
    from .build import default_knobs

    out = []
    for spec in specs:
        for phase in phases_of(spec, kind):
            if phases and phase not in phases:
                continue
            found = grid(spec, phase, kind)
            current = {**default_knobs(spec, target_of(kind)), **tuned_knobs(kind, spec)}
            first = [c for c in found if all(current.get(k) == v for k, v in c.items())][:1]
            rest = [c for c in found if c not in first]
            random.Random(f"{seed}/{spec.name}/{phase}").shuffle(rest)
            out.append([Candidate(spec, phase, c, baseline=True) for c in first]
                       + [Candidate(spec, phase, c) for c in rest])
    return out


def ms_lines(candidate: Candidate, grid_values: dict, target: dict) -> tuple[list, list]:
    """The candidate's workload line and trace in MetaSchedule's JSON forms, made by
    MetaSchedule itself (TVM's compiler): the workload is a stub PrimFunc naming the spec and
    phase; the trace annotates its root block with the spec, the phase and each knob, a
    `sample_categorical` over the knob's grid values decided on the candidate's value."""
    from .build import _tvm

    tvm = _tvm()
    from tvm.s_tir import meta_schedule as ms
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def workload():
        with T.sblock("root"):
            T.evaluate(0)

    func = workload.with_attr(SPEC_KEY, candidate.spec.name).with_attr(PHASE_KEY, candidate.phase)
    mod = tvm.IRModule({"main": func})
    sch = tvm.s_tir.Schedule(mod)
    root = sch.get_sblock("root")
    sch.annotate(root, SPEC_KEY, candidate.spec.name)
    sch.annotate(root, PHASE_KEY, candidate.phase)
    for name, value in sorted(candidate.knobs.items()):
        values = sorted(set(grid_values.get(name, ())) | {value})
        choice = sch.sample_categorical(values, [1 / len(values)] * len(values), decision=values.index(value))
        sch.annotate(root, name, choice)
    with tempfile.TemporaryDirectory(prefix="tvmflash-ms-") as tmp:
        db = ms.database.JSONDatabase(work_dir=tmp)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, db.commit_workload(mod), None,
                                                         tvm.target.Target(target), None))
        workload_line = json.loads(Path(tmp, "database_workload.json").read_text())
        record_line = json.loads(Path(tmp, "database_tuning_record.json").read_text())
    return workload_line, record_line[1][0]


class WorkDir:
    """A tuning run's directory: the MetaSchedule database of its measurements, the built
    candidates (`<spec>/<tag>.so`, indexed with their workload lines and traces in
    candidates.json, so timing them needs no compiler) and history.jsonl (time and best so far
    after each measurement)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.db = Database(self.path)
        index = self.path / "candidates.json"
        self.index = json.loads(index.read_text()) if index.exists() else {}
        self.measured = {(r.spec, r.phase, _tag(r.knobs)) for r in self.db.records}
        history = self.path / "history.jsonl"
        lines = history.read_text().splitlines() if history.exists() else []
        self.elapsed_before = json.loads(lines[-1])["elapsed_s"] if lines else 0.0

    def planned(self, specs: list, phases: tuple | None) -> list[list[Candidate]]:
        """Per workload, its indexed candidates in build order: the plan where there is no
        compiler (the grids' generators need it; what was not built cannot run anyway)."""
        from .deploy import spec_from_dict

        names = {s.name for s in specs}
        out: dict = {}
        for entry in self.index.values():
            spec = spec_from_dict(entry["spec"])
            if spec.name in names and (not phases or entry["phase"] in phases):
                out.setdefault((spec.name, entry["phase"]), []).append(Candidate(spec, entry["phase"], entry["knobs"]))
        return list(out.values())

    def is_measured(self, c: Candidate) -> bool:
        return (c.spec.name, c.phase, _tag(c.knobs)) in self.measured

    def retimed(self, candidates: list) -> dict:
        """(spec, phase) -> this run's seconds for each of `candidates` that it measured."""
        wanted = {(c.spec.name, c.phase, _tag(c.knobs)) for c in candidates}
        return {(r.spec, r.phase): r.secs for r in self.db.records
                if r.valid and (r.spec, r.phase, _tag(r.knobs)) in wanted}

    def build(self, c: Candidate, target: dict, grid_values: dict) -> None:
        """Index `c` (its workload line and trace) and compile it (its library unless a sibling
        built it); a compile error propagates, leaving the candidate indexed without a library."""
        from .build import build_module

        workload, trace = ms_lines(c, grid_values, target)
        self.index[c.key] = {"spec": c.spec.to_dict(), "phase": c.phase, "knobs": c.knobs, "lib": c.lib,
                             "target": target, "workload": workload, "trace": trace}
        tmp = self.path / "candidates.json.tmp"
        tmp.write_text(json.dumps(self.index, indent=1))
        tmp.replace(self.path / "candidates.json")
        lib = self.path / c.lib
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            build_knobs = {k: v for k, v in c.knobs.items() if k not in LAUNCH_KNOBS}
            only = None if target["kind"] == "cuda" else CPU_PHASE_KERNELS[c.phase]
            build_module(c.spec, target, build_knobs, only=only).export_library(str(lib))

    def record(self, c: Candidate, secs: float | None, elapsed_s: float) -> None:
        entry = self.index[c.key]
        self.db.add(entry["workload"], entry["trace"], [secs if secs is not None else FAILED_SECS], entry["target"])
        self.measured.add((c.spec.name, c.phase, _tag(c.knobs)))
        best = self.db.best()[(c.spec.name, c.phase)]
        with open(self.path / "history.jsonl", "a") as f:
            f.write(json.dumps({"elapsed_s": round(self.elapsed_before + elapsed_s, 2), "spec": c.spec.name,
                                "phase": c.phase, "knobs": c.knobs, "secs": secs, "best_secs": best.secs}) + "\n")


DEFAULT_SOFTCAP = 30.0  # a softcap spec's cap where no value is given (Gemma 2 uses 30 and 50)


def measure(c: Candidate, entry: dict, work_dir: Path, seqlens: tuple = SEQLENS, values: dict | None = None) -> float:
    """Seconds per call of candidate `c` (the geometric mean over `seqlens`; decode: over
    DECODE_SEQLENS), loaded from its library with TVM's runtime, after `check_candidate`
    (raises for wrong results); `values` are the variants' (window, softcap)."""
    from .build import _load

    target = entry["target"]
    module = _load(work_dir / entry["lib"], target)
    funcs = _PHASE_FUNCS["cuda" if target["kind"] == "cuda" else "cpu"]
    kern = {name: module[name] for name in funcs if module.implements_function(name, query_imports=True)}
    values = {**({"softcap": DEFAULT_SOFTCAP} if "softcap" in c.spec.variants else {}), **(values or {})}
    check_candidate(kern, c.spec, c.phase, "cuda" if target["kind"] == "cuda" else "cpu", values)
    if c.phase in DECODE_PHASES:
        times = [_time_decode(kern, c.spec, c.phase, c.knobs[f"{c.phase}_ctas_per_sm"], L, values)
                 for L in DECODE_SEQLENS]
    else:
        time_one = _time_one if target["kind"] == "cuda" else _time_one_cpu
        times = [time_one(kern, c.spec, L, c.phase == "backward", values) for L in seqlens]
    return math.prod(times) ** (1 / len(times)) / 1e3


def tune(kind: str, specs: list, phases: tuple | None = None, trials: int = 16, time_budget: float | None = None,
         work_dir: Path = Path("tvmflash-tune"), build_only: bool = False, seqlens: tuple = SEQLENS,
         merge: bool = True, values: dict | None = None, progress=None) -> dict:
    """Search the knob grids of `specs` on target `kind` (see the module doc). At most `trials`
    new measurements per workload, none started after `time_budget` seconds; `values` are the
    variants' values to time with (window, softcap). `progress(event, **info)` is told of each
    step (the CLI draws a progress bar from it). Returns a summary."""
    from .build import has_compiler

    work = WorkDir(work_dir)
    can_build, can_time = has_compiler(), runs_here(kind) and not build_only
    queues = []  # per workload: its unmeasured candidates with the workload's grid values (for traces)
    baselines = []  # the shipped records' knobs as candidates (a plan's, where there is a compiler)
    for workload in plan(kind, specs, phases) if can_build else work.planned(specs, phases):
        baselines += [c for c in workload if c.baseline]
        grid_values: dict = {}
        for c in workload:
            for k, v in c.knobs.items():
                grid_values.setdefault(k, set()).add(v)
        queues.append([(c, grid_values) for c in workload if not work.is_measured(c)][:trials])
    # interleaved, so a time budget is spent on every workload
    todo = [item for group in itertools.zip_longest(*queues) for item in group if item is not None]
    target = target_of(kind) if can_build else None
    notify = progress or (lambda event, **info: None)
    notify("start", total=len(todo), can_build=can_build, can_time=can_time)
    summary = {"measured": 0, "built": 0, "not_built": 0, "failed": 0, "out_of_time": 0}
    start = time.perf_counter()
    for c, grid_values in todo:
        if time_budget is not None and time.perf_counter() - start > time_budget:
            summary["out_of_time"] += 1
            notify("skip", candidate=c, reason="time budget")
            continue
        try:
            if c.key not in work.index or not (work.path / c.lib).exists():
                if not can_build:
                    summary["not_built"] += 1
                    notify("skip", candidate=c, reason="not built (no compiler here)")
                    continue
                work.build(c, target, grid_values)
                summary["built"] += 1
            if not can_time:
                notify("built", candidate=c)
                continue
            secs = measure(c, work.index[c.key], work.path, seqlens, values)
        except Exception as err:  # noqa: BLE001 - a candidate that fails to build or run is recorded
            secs = None  # as failed (MetaSchedule's 1e10 s), and the run goes on
            summary["failed"] += 1
            notify("failed", candidate=c, error=err)
        if c.key in work.index:
            work.record(c, secs, time.perf_counter() - start)
        summary["measured"] += secs is not None
        notify("measured", candidate=c, secs=secs, best=work.db.best()[(c.spec.name, c.phase)])
    summary["best"] = {f"{s}/{p}": r for (s, p), r in work.db.best().items()}
    summary["merged"] = work.db.merge_into(TUNING_LOGS_DIR / kind, work.retimed(baselines)) \
        if merge and work.db.records else []
    summary["elapsed_s"] = time.perf_counter() - start
    return summary


def time_to_fraction(history: list[dict], fraction: float = 0.95) -> dict:
    """Per workload: tuning seconds until its best so far was within `fraction` of its final
    best speed (from a work directory's history.jsonl)."""
    final = {}
    for h in history:
        final[(h["spec"], h["phase"])] = h["best_secs"]
    out = {}
    for h in history:
        key = (h["spec"], h["phase"])
        if key not in out and h["best_secs"] * fraction <= final[key]:
            out[key] = h["elapsed_s"]
    return out


def _decode_problem(kern: dict, spec: AttentionSpec, phase: str, per_sm: int, lengths: list, values: dict,
                    heads: int = 32, heads_k: int = 8):
    """A decode call as ops.decode_kv_cache makes it (one launch: the kernel merges its splits):
    one query per sequence of `lengths` keys in shuffled pages (DECODE_PAGES[phase] keys), by
    `phase`'s kernel at `per_sm` CTAs per SM (the automatic splits); `values` the variants'
    (window, softcap). Returns (call, its tensors)."""
    import torch

    from . import ops

    b, d, dt, page = len(lengths), spec.head_dim, getattr(torch, spec.dtype), DECODE_PAGES[phase]
    pages = -(-max(lengths) // page)
    slopes = _alibi_slopes(spec, heads, "cuda")
    args = ops._mod_args(spec, (b, heads, 1, pages * page), None, values.get("window", (-1, -1)),
                         values.get("softcap", 0.0), slopes)
    q = torch.randn(b, heads, 1, d, device="cuda", dtype=dt)
    k, v = (torch.randn(b * pages, page, heads_k, d, device="cuda", dtype=dt) for _ in range(2))
    table = torch.randperm(b * pages, device="cuda").view(b, pages).to(torch.int32)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    splits = ops.cuda_decode_splits(q.device, b * heads_k, pages * page, per_sm)
    o_part = torch.empty(b, heads, splits, 1, d, device="cuda")
    lse_part = torch.empty(b, heads, splits, 1, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(b, heads, 1, device="cuda")
    starts = torch.zeros_like(seqlens)
    counters = torch.zeros(b * heads_k, dtype=torch.int32, device="cuda")  # one row block per kv-head

    def call():
        kern[phase](q, k, v, table, seqlens, starts, 0, o_part, lse_part, out, lse, counters, d ** -0.5, *args)
    return call, dict(q=q, k=k, v=v, table=table, seqlens=seqlens, out=out, lse=lse, slopes=slopes, page=page)


def _time_decode(kern: dict, spec: AttentionSpec, phase: str, per_sm: int, length: int, values: dict) -> float:
    """Milliseconds per decode call of `phase`'s kernel, B=16, H=32, Hk=8, `length` keys
    (`_decode_problem`)."""
    call, _ = _decode_problem(kern, spec, phase, per_sm, [length] * 16, values)
    call()
    return _cuda_ms(call)


CHECK_TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}  # relative, and of the mean |value|
LSE_TOLERANCE = 2e-3  # (computed in fp32 from the same inputs on both sides)


def check_candidate(kern: dict, spec: AttentionSpec, phase: str, device: str, values: dict | None = None) -> None:
    """Raise ValueError where a candidate's results differ from `tvmflash.reference` (fp32, or
    fp64 on CPUs): |got - want| <= tol (mean |want| + |want|), tol by dtype; lse within
    LSE_TOLERANCE. A knob setting that builds but computes wrong results (a race, a missed
    tile) must not be timed, let alone merged. A small odd-sized problem (partial tiles): the
    forward's o and lse (every forward kernel of a CPU module), the backward's dQ, dK and dV,
    a decode kernel's o and lse over ragged and empty sequences."""
    import torch

    from .reference import attention

    torch.manual_seed(0)
    values = values or {}
    exact = torch.float32 if device == "cuda" else torch.float64

    def compare(name, got, want):
        want = want.to(exact)
        finite = ~torch.isinf(want)  # rows that see no key: lse -inf on both sides
        got = got.to(exact).where(finite, want)
        if name.endswith("lse"):
            bound = torch.full_like(want, LSE_TOLERANCE)
        else:
            tol = CHECK_TOLERANCE[spec.dtype]
            bound = tol * (want.abs().mean().clamp(min=1.0) + want.abs())
        excess = ((got - want).abs() - bound).where(finite, 0)
        if excess.numel() and not excess.max().item() <= 0:  # (NaN fails too)
            worst = excess.nan_to_num(float("inf")).argmax()
            err = (got - want).abs().flatten()[worst].item()
            raise ValueError(f"{spec.name} {phase}: {name} is off by {err:.3g} (tolerance "
                             f"{bound.flatten()[worst].item():.3g})")

    modifiers = dict(causal=spec.causal, window=values.get("window", (-1, -1)), softcap=values.get("softcap", 0.0))
    if phase in DECODE_PHASES:
        lengths = [300, 123, 0, 17]
        call, t = _decode_problem(kern, spec, phase, 3, lengths, values, heads=8, heads_k=2)
        call()
        torch.cuda.synchronize()
        for b, n in enumerate(lengths):
            rows = torch.arange(n, device="cuda")
            k, v = (c[t["table"][b, rows // t["page"]].long(), rows % t["page"]].transpose(0, 1)[None]
                    for c in (t["k"], t["v"]))
            o, lse = attention(t["q"][b:b + 1], k, v, dtype=exact, alibi_slopes=t["slopes"], **modifiers)
            compare(f"sequence {b}'s o", t["out"][b:b + 1], o)
            compare(f"sequence {b}'s lse", t["lse"][b:b + 1], lse)
        return
    forward, backward, t = _attention_problem(kern, spec, 2, 3, 77, values, device)
    q, k, v = (t[n].to(exact).requires_grad_() for n in "qkv")
    o, lse = attention(q, k, v, dtype=exact, alibi_slopes=_alibi_slopes(spec, 3, device), **modifiers)
    # (a CPU backward candidate's library holds the backward's kernels only)
    names = [n for n in ("forward", "forward_long") if n in kern] if device != "cuda" else ["forward"]
    for name in names:
        forward(name)
        if device == "cuda":
            torch.cuda.synchronize()
        compare(f"{name}'s o", t["o"], o)
        compare(f"{name}'s lse", t["lse"], lse)
    if phase == "backward":
        with torch.no_grad():  # the backward's inputs: the reference's o and lse where no forward ran
            if not names:
                t["o"].copy_(o)
                t["lse"].copy_(lse)
        backward()
        if device == "cuda":
            torch.cuda.synchronize()
        for name, grad in zip(("dq", "dk", "dv"), torch.autograd.grad(o, (q, k, v), t["do"].to(exact))):
            compare(name, t[name], grad)


_PHASE_FUNCS = {"cuda": ("forward", "backward_prep", "backward_dkdv_dq", "backward_dq_convert", "backward_dkdv",
                         "backward_dq", *DECODE_PHASES),
                "cpu": tuple(dict.fromkeys(sum(CPU_PHASE_KERNELS.values(), ())))}


def _shape(spec: AttentionSpec, seqlen: int, kind: str) -> tuple:
    """(batch, heads) of the benchmark at `seqlen`."""
    return (16384 // seqlen, 2048 // spec.head_dim) if kind == "cuda" else (1, 16)


def _alibi_slopes(spec: AttentionSpec, heads: int, device):
    """The usual geometric ALiBi slopes (heads,) for an ALiBi spec, else None."""
    import torch

    return 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=device) / heads) if "alibi" in spec.variants else None


def _mod_args(spec: AttentionSpec, q, values: dict) -> tuple:
    """The variants' kernel arguments for timing (`values`: window, softcap; `_alibi_slopes`)."""
    from . import ops

    if spec.mask != "none" or spec.flex or {"dropout", "varlen"} & set(spec.variants):
        raise ValueError(f"tuning takes plain, causal, window, softcap and ALiBi specs, not {spec.name}")
    b, h, length, _ = q.shape
    return ops._mod_args(spec, (b, h, length, length), None, values.get("window", (-1, -1)),
                         values.get("softcap", 0.0), _alibi_slopes(spec, h, q.device))


def _attention_problem(kern: dict, spec: AttentionSpec, batch: int, heads: int, seqlen: int, values: dict,
                       device: str) -> tuple:
    """(forward, backward, tensors): calls of the module's forward and backward (CUDA: prep,
    dK/dV/dQ, convert; CPU: delta, the planned dK/dV/dQ kernels, packs) on random inputs, as
    ops calls them; the backward uses the o and lse of the last forward."""
    import torch

    from .ops import _backward_cpu, _backward_cuda, _forward_kernel_name, _forward_tail_args

    dt = getattr(torch, spec.dtype)
    q, k, v, do = (torch.randn(batch, heads, seqlen, spec.head_dim, device=device, dtype=dt) for _ in range(4))
    o, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
    lse = torch.zeros(batch, heads, seqlen, device=device, dtype=torch.float32)
    scale, args = spec.head_dim ** -0.5, _mod_args(spec, q, values)
    if device == "cuda":
        def forward(name="forward"):
            kern[name](q, k, v, o, lse, scale, *args, *_forward_tail_args(kern, q, k, v))

        def backward():
            _backward_cuda(kern, do, q, k, v, o, lse, None, args, scale, False, dq, dk, dv)
    else:
        from .cpu import request_amx

        request_amx()  # before the first AMX kernel of the process

        def forward(name=None):
            kern[name or _forward_kernel_name(kern, q, k)](q, k, v, o, lse, scale, *args,
                                                           *_forward_tail_args(kern, q, k, v))

        def backward():
            _backward_cpu(kern, do, q, k, v, o, lse, None, args, scale, dq, dk, dv)
    return forward, backward, dict(q=q, k=k, v=v, do=do, o=o, lse=lse, dq=dq, dk=dk, dv=dv)


def _time_one(kern: dict, spec: AttentionSpec, seqlen: int, backward: bool, values: dict) -> float:
    """Milliseconds per call of the forward, or of the backward (prep, dK/dV/dQ, convert)."""
    from .ops import _on_stream

    forward, backward_call, t = _attention_problem(kern, spec, *_shape(spec, seqlen, "cuda"), seqlen, values, "cuda")
    call = backward_call if backward else forward
    with _on_stream(t["q"].device):
        forward()
        for _ in range(3):
            call()
        return _cuda_ms(call)


def _cuda_ms(call, iters: int = 20) -> float:
    """Milliseconds per call of `call` over `iters` back-to-back calls (CUDA events)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


CPU_SAMPLES, CPU_SAMPLE_S = 3, 0.1  # a CPU candidate's time: median of this many samples of >= this long


def _time_one_cpu(kern: dict, spec: AttentionSpec, seqlen: int, backward: bool, values: dict) -> float:
    """Milliseconds per call of the forward (with its packs), or of the backward (delta, the
    planned dK/dV/dQ kernels, packs): the median of CPU_SAMPLES samples after a warm-up call."""
    import statistics
    import time as clock

    forward, backward_call, _ = _attention_problem(kern, spec, *_shape(spec, seqlen, "cpu"), seqlen, values, "cpu")
    call = backward_call if backward else forward
    start = clock.perf_counter()
    call()
    iters = max(1, int(CPU_SAMPLE_S / max(clock.perf_counter() - start, 1e-6)))
    samples = []
    for _ in range(CPU_SAMPLES):
        start = clock.perf_counter()
        for _ in range(iters):
            call()
        samples.append((clock.perf_counter() - start) / iters * 1e3)
    return statistics.median(samples)
