"""The tuner: candidate grids, the MetaSchedule database of records, the tune loop on the host
CPU (the CUDA and AVX512 timing itself runs on the GPU machine and its Xeon)."""
import json

import pytest
import torch

from tvmflash import tune
from tvmflash.schedules.cuda_mma import SHARED_LIMIT
from tvmflash.spec import AttentionSpec


def test_candidates_respect_shared_memory_and_registers():
    for d in (64, 128, 256):
        for knobs in tune.candidates(AttentionSpec("float16", d), arch="sm_80"):
            assert (knobs["block_m"] + 2 * knobs["stages"] * knobs["block_n"]) * (d + 8) * 2 <= SHARED_LIMIT
            assert not (knobs["q_in_registers"] and d > 128)
            assert knobs["warp_m_tiles"] == 1 or d <= 128
    assert len(tune.candidates(AttentionSpec("float16", 64), arch="sm_80")) == 40  # (12 one-tile + 8 two-tile) x 2 rings
    assert "block_m" in tune.candidates(AttentionSpec("float16", 96))[0]  # sm_90a, no wgmma kernel for 96
    softcap = tune.candidates(AttentionSpec("bfloat16", 128, variants=("softcap",)))
    assert sorted({c["wgmma_poly_exp2"] for c in softcap}) == [0, 1, 2]
    assert len(softcap) == 3 * len(tune.candidates(AttentionSpec("bfloat16", 128)))
    # a flex block mask's tile lists: staged in shared memory or read in place
    from tvmflash.flex import flex_spec

    masked = flex_spec(torch.bfloat16, 128, None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    lists = tune.candidates(masked)
    staged = [c for c in lists if "wgmma_stage_lists" in c]
    assert masked.block_sparse and sorted({c["wgmma_stage_lists"] for c in staged}) == [0, 1]
    # (the persistent candidates read the lists in place: once a tile shape)
    plain = tune.candidates(AttentionSpec("bfloat16", 128))
    assert len(staged) == 2 * len([c for c in plain if "wgmma_persistent" not in c])
    assert len(lists) - len(staged) == len(plain) - len([c for c in plain if "wgmma_persistent" not in c])


def test_hopper_candidates_are_the_wgmma_knobs_that_fit():
    # D=256: block_n 128 does not fit shared memory; D=128: the warp-specialized loop (two
    # warpgroups) also persistent with drawn items
    for d, count in ((64, 4), (128, 6), (256, 2)):
        cands = tune.candidates(AttentionSpec("bfloat16", d))
        assert len(cands) == count and all(c["forward_wgmma"] == 1 for c in cands)
        assert all((64 * c["wgmma_warpgroups"] + 4 * c["wgmma_block_n"]) * d * 2 <= SHARED_LIMIT for c in cands)
        drawn = [c for c in cands if c.get("wgmma_persistent") == 2]
        assert len(drawn) == (2 if d == 128 else 0) and all(c["wgmma_warpgroups"] == 2 for c in drawn)
    assert tune.candidates(AttentionSpec("float16", 128), "backward") == [
        {"bwd_wgmma": 1, "bwd_wgmma_warpgroups": wg, "bwd_wgmma_block_m": 64} for wg in (1, 2)]
    assert len(tune.candidates(AttentionSpec("float16", 64), "backward")) == 4  # block_m 128 too


def test_backward_candidates_fit_shared_memory():
    for d in (64, 128, 256):
        cands = tune.candidates(AttentionSpec("float16", d), "backward", arch="sm_80")
        assert cands and all(set(c) == {"bwd_block_n", "bwd_block_m", "bwd_stages", "bwd_d_split"} for c in cands)
        assert all((c["bwd_d_split"] == 2) == (d > 128) for c in cands)


def test_cpu_candidates_are_block_sizes_and_register_tiles():
    fwd = tune.cpu_candidates(AttentionSpec("float32", 64), "forward")
    assert len(fwd) == len(tune.CPU_BLOCKS) * len(tune.CPU_REGISTER_TILES)
    assert all(c["forward.qk.rows"] * c["forward.qk.vecs"] <= 16 for c in fwd)  # accumulators fit 32 zmm
    bwd = tune.cpu_candidates(AttentionSpec("float32", 64), "backward")
    assert all("bwd_block_q" in c and "backward_dq.dq.vecs" in c and "block_q" not in c for c in bwd)
    # AMX kernels (bf16, D % 32 == 0) have no register-tile knobs; blocks are multiples of 32
    amx = tune.cpu_candidates(AttentionSpec("bfloat16", 128), "backward")
    assert [sorted(c) for c in amx] == [["bwd_block_k", "bwd_block_q"]] * len(tune.CPU_BLOCKS)
    assert all(c["bwd_block_q"] % 32 == 0 and c["bwd_block_k"] % 32 == 0 for c in amx)
    # the AMX forward also picks the q-blocks of its long-key kernel
    amx_fwd = tune.cpu_candidates(AttentionSpec("bfloat16", 128), "forward")
    assert len(amx_fwd) == len(tune.CPU_BLOCKS) * len(tune.AMX_LONG_BLOCK_Q)
    assert {c["long_block_q"] for c in amx_fwd} == set(tune.AMX_LONG_BLOCK_Q)


def test_cpu_phases_cover_every_kernel_of_an_amx_module():
    """A tuning candidate is built with its phase's kernels only (CPU_PHASE_KERNELS): every
    kernel the AVX512/AMX schedule generates must belong to a phase, or its knobs (e.g.
    long_block_q of `forward_long`) would be tuned without the kernel they shape."""
    from tvmflash.build import AVX512_TARGET
    from tvmflash.schedules import avx512

    knobs = {**avx512.DEFAULTS, "block_q": 64, "long_block_q": 256}
    names = set(avx512.kernels(AttentionSpec("bfloat16", 128), AVX512_TARGET, knobs))
    untuned = {n for n in names if n.startswith("forward_split")}  # split-KV decode: no knobs (host.py)
    assert "forward_long" in names
    assert untuned == {"forward_split", "forward_split_row", "forward_split_tiles", "forward_split_combine"}
    assert names - untuned <= set(sum(tune.CPU_PHASE_KERNELS.values(), ()))


def test_cpu_specs_without_a_record_take_the_plain_specs():
    from tvmflash.tuning import tuned_knobs

    plain = tuned_knobs("avx512", AttentionSpec("bfloat16", 64))
    assert plain  # tuning_logs/avx512/ holds the benchmark specs
    assert tuned_knobs("avx512", AttentionSpec("bfloat16", 64, mask="bool", variants=("softcap",))) == plain
    # causal specs: the causal record's forward knobs over the plain spec's (its backward knobs)
    causal = tuned_knobs("avx512", AttentionSpec("bfloat16", 64, causal="bottom_right"))
    assert causal != plain and causal["bwd_block_k"] == plain["bwd_block_k"]
    assert tuned_knobs("avx512", AttentionSpec("bfloat16", 64, causal="top_left", mask="bool")) == causal
    assert tuned_knobs("avx512", AttentionSpec("float32", 64, causal="top_left")) == tuned_knobs(
        "avx512", AttentionSpec("float32", 64))  # no causal record: the plain spec's
    assert tuned_knobs("avx512", AttentionSpec("bfloat16", 80)) == {}  # other head dims: defaults
    assert tuned_knobs("cuda", AttentionSpec("bfloat16", 64, mask="bool")) == {}  # CUDA: exact records only


@pytest.mark.parametrize("phase", ["decode", "decode_long"])
def test_decode_candidates_and_records(phase):
    from tvmflash.tuning import tuned_knobs

    cands = tune.candidates(AttentionSpec("bfloat16", 128, kv_cache=True), phase)
    names = {f"{phase}_{k}" for k in ("block_n", "warps", "stages", "l2_prefetch")}
    assert cands and all(set(c) == names for c in cands)
    block_n, warps, stages = (lambda c, k=k: c[f"{phase}_{k}"] for k in ("block_n", "warps", "stages"))
    # head dim 128: unpadded (swizzled) shared-memory rows of 256 bytes, Q's 16 rows and the K/V ring
    assert all((16 + 2 * stages(c) * block_n(c)) * 128 * 2 <= SHARED_LIMIT for c in cands)
    assert all(block_n(c) % (16 * warps(c)) == 0 for c in cands)  # 16-key slices per warp
    assert {warps(c) for c in cands} == {1, 2, 4, 8}
    assert {c[f"{phase}_l2_prefetch"] for c in cands} == {0}  # 256 only added L2 traffic (cuda_decode.py)
    full = tune.grid(AttentionSpec("bfloat16", 128, kv_cache=True), phase, "cuda")
    assert {c[f"{phase}_ctas_per_sm"] for c in full if warps(c) == 4} == {1, 2, 3}
    assert tune.phases_of(AttentionSpec("bfloat16", 128, kv_cache=True), "cuda") == ("decode", "decode_long")
    # a causal / windowed decode spec takes the plain decode record (tuning_logs/cuda/ has it)
    plain = tuned_knobs("cuda", AttentionSpec("bfloat16", 128, kv_cache=True))
    assert "decode_ctas_per_sm" in plain
    assert tuned_knobs("cuda", AttentionSpec("bfloat16", 128, "bottom_right", variants=("window",), kv_cache=True)) == plain


def test_decode_phase_by_page_size():
    """Pages of 128 keys or more, and contiguous caches (one page of the capacity), take the
    long-page decode kernel, with one CTA an SM by default (no splits at B x Hk >= SMs)."""
    from tvmflash import ops

    assert [ops.decode_phase(p) for p in (16, 48, 112, 128, 256, 4096)] == ["decode"] * 3 + ["decode_long"] * 3
    assert ops.DECODE_CTAS_PER_SM["decode_long"] == 1
    _, per_sm = ops._decode_spec(torch.bfloat16, 128, False, (-1, -1), False, False)
    assert set(per_sm) == {"decode", "decode_long"} and per_sm["decode"] == 2  # the shipped record's


def _record(db, spec, phase, knobs, secs, kind="cuda"):
    values = {k: {v} for k, v in knobs.items()}
    workload, trace = tune.ms_lines(tune.Candidate(spec, phase, knobs), values, tune.target_of(kind))
    return db.add(workload, trace, None if secs is None else [secs], tune.target_of(kind))


def test_merge_measures_the_old_record_by_this_runs_time_of_its_knobs(tmp_path):
    """A record timed in another session (other kernels, another host load) is beaten by a run
    whose best is faster than the run's own time of the record's knobs, though slower than the
    time stored with the record; without that re-timing the stored time decides."""
    from tvmflash.tuning import Database

    spec = AttentionSpec("bfloat16", 64)
    shipped = Database(tmp_path / "shipped")
    _record(shipped, spec, "forward", {"block_q": 64}, 1e-3)
    run = Database(tmp_path / "run")
    _record(run, spec, "forward", {"block_q": 64}, 2e-3)  # the record's knobs, re-timed
    _record(run, spec, "forward", {"block_q": 32}, 1.5e-3)
    assert run.merge_into(tmp_path / "shipped") == []  # 1.5 ms loses to the stored 1 ms
    changed = run.merge_into(tmp_path / "shipped", {(spec.name, "forward"): 2e-3})
    assert [(r.knobs, old.knobs) for r, old in changed] == [({"block_q": 32}, {"block_q": 64})]
    assert Database(tmp_path / "shipped").knobs(spec.name) == {"block_q": 32}


def test_plan_starts_from_the_knobs_a_build_takes():
    """The baseline is the candidate a build takes now, a record's knobs over the schedule's
    defaults (the shipped bf16 D = 64 AMX record sets no long_block_q: the default fills it)."""
    from tvmflash.build import AVX512_TARGET, default_knobs
    from tvmflash.tuning import tuned_knobs

    spec = AttentionSpec("bfloat16", 64)
    (workload,) = tune.plan("avx512", [spec], ("forward",))
    current = {**default_knobs(spec, AVX512_TARGET), **tuned_knobs("avx512", spec)}
    assert workload[0].baseline and not any(c.baseline for c in workload[1:])
    assert workload[0].knobs == {k: current[k] for k in workload[0].knobs}
    assert "long_block_q" in workload[0].knobs


def test_database_is_metaschedules_and_keeps_the_fastest_per_workload(tmp_path):
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from tvmflash.tuning import Database

    spec, other = AttentionSpec("float16", 64), AttentionSpec("bfloat16", 128, causal="top_left")
    shipped = Database(tmp_path / "shipped")
    _record(shipped, other, "forward", {"block_m": 64}, 1e-3)
    _record(shipped, spec, "forward", {"block_m": 64}, 2e-3)
    _record(shipped, spec, "decode", {"decode_block_n": 16}, None)  # unmeasured: kept until measured
    shipped.merge_into(tmp_path / "shipped")  # compacts: one record per workload
    run = Database(tmp_path / "run")
    for bm, secs in ((64, 2.5e-3), (128, 1.5e-3), (32, 3e-3)):
        _record(run, spec, "forward", {"block_m": bm}, secs)
    for bn, bm, secs in ((128, 64, 3e-3), (64, 32, 2.5e-3)):
        _record(run, spec, "backward", {"bwd_block_n": bn, "bwd_block_m": bm}, secs)
    _record(run, other, "forward", {"block_m": 128}, 1.2e-3)  # slower than the shipped record
    changed = run.merge_into(tmp_path / "shipped")
    assert sorted((r.spec, r.phase) for r, _ in changed) == [(spec.name, "backward"), (spec.name, "forward")]

    merged = Database(tmp_path / "shipped")
    assert len(merged.records) == len(merged.workloads) == 4
    assert merged.knobs(spec.name) == {"block_m": 128, "bwd_block_n": 64, "bwd_block_m": 32, "decode_block_n": 16}
    assert merged.knobs(other.name) == {"block_m": 64}
    # MetaSchedule reads it: the best record per workload, the knobs as root-block annotations
    db = ms.database.JSONDatabase(work_dir=str(tmp_path / "shipped"), allow_missing=False)
    forward = [r for r in db.get_all_tuning_records()
               if str(r.workload.mod["main"].attrs["tvmflash.spec"]) == spec.name
               and str(r.workload.mod["main"].attrs["tvmflash.phase"]) == "forward"]
    best = db.get_top_k(forward[0].workload, 1)[0]
    assert float(best.run_secs[0]) == pytest.approx(1.5e-3)
    sch = tvm.s_tir.Schedule(best.workload.mod)
    best.trace.apply_to_schedule(sch, remove_postproc=False)
    assert int(sch.get(sch.get_sblock("root")).annotations["block_m"]) == 128


def test_time_to_fraction():
    history = [{"spec": "s", "phase": "forward", "elapsed_s": t, "best_secs": b}
               for t, b in ((1, 2.0), (2, 1.2), (3, 1.04), (4, 1.0))]
    assert tune.time_to_fraction(history) == {("s", "forward"): 3}


def test_presets_and_spec_syntax():
    from tvmflash.presets import MODEL_PRESETS, parse_spec

    assert parse_spec("bf16:d128:causal:window") == AttentionSpec("bfloat16", 128, "bottom_right", variants=("window",))
    assert parse_spec("fp16:d64:alibi:softcap:kvcache") == AttentionSpec("float16", 64, variants=("softcap", "alibi"),
                                                                           kv_cache=True)
    assert parse_spec("float32_d64_causal-top_left_mask-none") == AttentionSpec("float32", 64, "top_left")
    for bad in ("bf16", "bf16:128", "int8:d64", "bf16:d64:sliding"):
        with pytest.raises(ValueError, match="spec"):
            parse_spec(bad)
    gemma = MODEL_PRESETS["gemma2-9b"]
    assert [s.name for s in gemma.specs()] == [
        "bfloat16_d256_causal-bottom_right_mask-none_softcap", "bfloat16_d256_causal-bottom_right_mask-none_softcap-window",
        "bfloat16_d256_causal-bottom_right_mask-none_softcap_kvcache",
        "bfloat16_d256_causal-bottom_right_mask-none_softcap-window_kvcache"]
    assert gemma.values == {"window": (4096, 0), "softcap": 50.0}
    assert [s.variants for s in MODEL_PRESETS["mistral-7b"].specs(decode=False)] == [("window",)]
    assert MODEL_PRESETS["llama3-8b"].specs("float32") == [AttentionSpec("float32", 128, "bottom_right")]


@pytest.fixture
def logs(tmp_path, monkeypatch):
    """tuning_logs/ in a temporary directory."""
    monkeypatch.setattr(tune, "TUNING_LOGS_DIR", tmp_path / "logs")
    return tmp_path / "logs"


def test_tune_on_the_host_resumes_and_merges(tmp_path, logs):
    """Two runs of one trial each: two different candidates measured (the first the current
    record, which the host has none of here), history and database grow, the best is merged."""
    spec = AttentionSpec("float32", 32)
    work = tmp_path / "work"
    for run in range(2):
        summary = tune.tune("host", [spec], ("forward",), trials=1, work_dir=work, seqlens=(64,))
        assert summary["measured"] == 1 and summary["built"] == 1
    history = [json.loads(line) for line in (work / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and history[0]["knobs"] != history[1]["knobs"]
    assert history[1]["elapsed_s"] > history[0]["elapsed_s"]
    from tvmflash.tuning import Database

    best = min(h["secs"] for h in history)
    merged = Database(logs / "host")
    assert [r.secs for r in merged.records] == [pytest.approx(best)]
    assert tune.tune("host", [spec], ("forward",), trials=0, work_dir=work)["measured"] == 0


def test_tune_builds_here_and_times_where_the_runtime_is(tmp_path, logs, monkeypatch):
    """--build-only, then a run without TVM's compiler times what was built and builds nothing."""
    from tvmflash import build

    spec, work = AttentionSpec("float32", 32), tmp_path / "work"
    built = tune.tune("host", [spec], ("forward",), trials=2, work_dir=work, build_only=True, merge=False)
    assert built["built"] == 2 and built["measured"] == 0 and not (work / "history.jsonl").exists()
    monkeypatch.setattr(build, "has_compiler", lambda: False)
    timed = tune.tune("host", [spec], ("forward",), trials=3, work_dir=work, seqlens=(64,), merge=False)
    assert timed["measured"] == 2 and timed["built"] == 0  # the plan: what was built


def test_a_candidate_that_fails_to_build_is_recorded_as_failed(tmp_path, logs, monkeypatch):
    from tvmflash import build
    from tvmflash.tuning import Database

    real = build.build_module

    def flaky(spec, target, knobs=None, only=None):
        if knobs.get("block_q") == 256:
            raise RuntimeError("does not compile")
        return real(spec, target, knobs, only)

    monkeypatch.setattr(build, "build_module", flaky)
    spec = AttentionSpec("float32", 32)
    (planned,) = tune.plan("host", [spec], ("forward",))
    trials = next(n for n in range(1, len(planned) + 1) if planned[n - 1].knobs["block_q"] == 256) + 1
    summary = tune.tune("host", [spec], ("forward",), trials=trials, work_dir=tmp_path, seqlens=(64,), merge=False)
    failed = [r for r in Database(tmp_path).records if not r.valid]
    bad = sum(c.knobs["block_q"] == 256 for c in planned[:trials])
    assert summary["failed"] == len(failed) == bad and all(r.knobs["block_q"] == 256 for r in failed)
    assert summary["measured"] == trials - bad > 0


@pytest.mark.parametrize("spec", [AttentionSpec("float32", 64), AttentionSpec("bfloat16", 64, causal="bottom_right",
                                                                             variants=("softcap", "alibi"))],
                         ids=["fp32", "bf16-causal-softcap-alibi"])  # (specs the CPU tests build anyway)
def test_candidates_with_wrong_results_are_rejected(spec):
    """check_candidate passes the shipped module (forward: o and lse; backward: dQ, dK, dV, also
    from a library of the backward's kernels only, as a CPU backward candidate's; `tvmflash
    tune` calls it before timing) and rejects one whose forward is wrong in the partial
    tile's last row, or NaN."""
    import torch

    from tvmflash.ops import _kernels

    kern = dict(_kernels(spec, torch.device("cpu")))
    values = {"softcap": tune.DEFAULT_SOFTCAP} if "softcap" in spec.variants else {}
    for phase in ("forward", "backward"):
        tune.check_candidate(kern, spec, phase, "cpu", values)
    backward_only = {name: f for name, f in kern.items() if name in tune.CPU_PHASE_KERNELS["backward"]}
    tune.check_candidate(backward_only, spec, "backward", "cpu", values)  # as a backward candidate's library
    good = kern["forward"]

    def last_row_off(q, k, v, o, lse, *rest):
        good(q, k, v, o, lse, *rest)
        o[:, :, -1] += 0.1

    def nan(q, k, v, o, lse, *rest):
        good(q, k, v, o, lse, *rest)
        lse[0, 0, 0] = float("nan")

    with pytest.raises(ValueError, match="forward's o is off by 0.1"):
        tune.check_candidate({**kern, "forward": last_row_off}, spec, "forward", "cpu", values)
    with pytest.raises(ValueError, match="forward's lse is off by nan"):
        tune.check_candidate({**kern, "forward": nan}, spec, "backward", "cpu", values)


def test_tune_stops_at_the_time_budget(tmp_path, logs):
    summary = tune.tune("host", [AttentionSpec("float32", 32)], trials=4, time_budget=0, work_dir=tmp_path)
    assert summary["measured"] == 0 and summary["out_of_time"] == 8  # 4 forward + 4 backward
    assert not (logs / "host").exists()


def test_tune_command_line(tmp_path, logs):
    from typer.testing import CliRunner

    from tvmflash.cli import app

    result = CliRunner().invoke(app, ["tune", "--target", "host", "--spec", "fp32:d32:causal", "--phase", "forward",
                                      "--trials", "1", "--seqlen", "64", "--work-dir", str(tmp_path / "w")])
    assert result.exit_code == 0, result.output
    assert "1 measured, 1 built" in result.output and "tuning_logs/host" in result.output
    result = CliRunner().invoke(app, ["tune", "--target", "host", "--model-preset", "nope"])
    assert result.exit_code != 0 and "llama3-8b" in result.output


def test_tune_a_model_preset(tmp_path, logs):
    """A preset's specs with its variants' values (Mistral's sliding window) through the CLI."""
    from typer.testing import CliRunner

    from tvmflash.cli import app

    result = CliRunner().invoke(app, ["tune", "--target", "host", "--model-preset", "mistral-7b", "--dtype", "fp32",
                                      "--phase", "forward", "--trials", "1", "--seqlen", "64", "--no-merge",
                                      "--work-dir", str(tmp_path / "w")])
    assert result.exit_code == 0, result.output
    assert "1 measured" in result.output and "window" in result.output and not (logs / "host").exists()
