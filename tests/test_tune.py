"""The tuner's bookkeeping (the timing itself runs on the GPU machine and its Xeon)."""
import json

from tvmflash import tune
from tvmflash.spec import AttentionSpec


def test_candidates_respect_shared_memory_and_registers():
    for d in (64, 128, 256):
        for knobs in tune.candidates(AttentionSpec("float16", d), arch="sm_80"):
            assert (knobs["block_m"] + 2 * knobs["stages"] * knobs["block_n"]) * (d + 8) * 2 <= tune.SMEM_LIMIT
            assert not (knobs["q_in_registers"] and d > 128)
            assert knobs["warp_m_tiles"] == 1 or d <= 128
    assert len(tune.candidates(AttentionSpec("float16", 64), arch="sm_80")) == 40  # (12 one-tile + 8 two-tile) x 2 rings
    assert "block_m" in tune.candidates(AttentionSpec("float16", 96))[0]  # sm_90a, no wgmma kernel for 96


def test_hopper_candidates_are_the_wgmma_knobs_that_fit():
    for d, count in ((64, 4), (128, 4), (256, 2)):  # D=256: block_n 128 does not fit shared memory
        cands = tune.candidates(AttentionSpec("bfloat16", d))
        assert len(cands) == count and all(c["forward_wgmma"] == 1 for c in cands)
        assert all((64 * c["wgmma_warpgroups"] + 4 * c["wgmma_block_n"]) * d * 2 <= tune.SMEM_LIMIT for c in cands)
    assert tune.candidates(AttentionSpec("float16", 128), "backward") == [
        {"bwd_wgmma": 1, "bwd_wgmma_warpgroups": wg, "bwd_wgmma_block_m": 64} for wg in (1, 2)]
    assert len(tune.candidates(AttentionSpec("float16", 64), "backward")) == 4  # block_m 128 too


def test_record_keeps_the_fastest_candidate_per_spec(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setattr(tune, "TUNING_LOGS_DIR", logs)
    (logs / "cuda").mkdir(parents=True)
    (logs / "cuda" / "knobs.json").write_text(json.dumps({"other_spec": {"block_m": 64}}))
    spec = AttentionSpec("float16", 64)
    timings = [{"spec": spec.to_dict(), "knobs": {"block_m": bm}, "ms": ms, "tflops": 1.0}
               for bm, ms in ((64, 2.0), (128, 1.5), (32, 3.0))]
    (tmp_path / "timings.json").write_text(json.dumps(timings))
    tune.record(tmp_path)
    records = json.loads((logs / "cuda" / "knobs.json").read_text())
    assert records == {"other_spec": {"block_m": 64}, spec.name: {"block_m": 128}}


def test_record_merges_forward_and_backward_phases(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setattr(tune, "TUNING_LOGS_DIR", logs)
    spec = AttentionSpec("bfloat16", 128, causal="top_left")
    timings = [{"spec": spec.to_dict(), "phase": "forward", "knobs": {"block_m": 64}, "ms": 1.0, "tflops": 1.0},
               {"spec": spec.to_dict(), "phase": "backward", "knobs": {"bwd_block_n": 128, "bwd_block_m": 64},
                "ms": 3.0, "tflops": 1.0},
               {"spec": spec.to_dict(), "phase": "backward", "knobs": {"bwd_block_n": 64, "bwd_block_m": 32},
                "ms": 2.5, "tflops": 1.0}]
    (tmp_path / "timings.json").write_text(json.dumps(timings))
    tune.record(tmp_path)
    records = json.loads((logs / "cuda" / "knobs.json").read_text())
    assert records == {spec.name: {"block_m": 64, "bwd_block_n": 64, "bwd_block_m": 32}}


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


def test_record_writes_each_targets_log(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setattr(tune, "TUNING_LOGS_DIR", logs)
    spec = AttentionSpec("bfloat16", 64)
    timings = [{"spec": spec.to_dict(), "target": "avx512", "phase": "backward",
                "knobs": {"bwd_block_q": bq}, "ms": ms, "gflops": {}} for bq, ms in ((64, 2.0), (128, 1.0))]
    timings.append({"spec": spec.to_dict(), "target": "cuda", "knobs": {"block_m": 64}, "ms": 1.0, "tflops": {}})
    (tmp_path / "timings.json").write_text(json.dumps(timings))
    tune.record(tmp_path)
    assert json.loads((logs / "avx512" / "knobs.json").read_text()) == {spec.name: {"bwd_block_q": 128}}
    assert json.loads((logs / "cuda" / "knobs.json").read_text()) == {spec.name: {"block_m": 64}}


def test_cpu_specs_without_a_record_take_the_plain_specs():
    from tvmflash.tuning import tuned_knobs

    plain = tuned_knobs("avx512", AttentionSpec("bfloat16", 64))
    assert plain  # tuning_logs/avx512/knobs.json holds the benchmark specs
    assert tuned_knobs("avx512", AttentionSpec("bfloat16", 64, causal="bottom_right", mask="bool")) == plain
    assert tuned_knobs("avx512", AttentionSpec("bfloat16", 80)) == {}  # other head dims: defaults
    assert tuned_knobs("cuda", AttentionSpec("bfloat16", 64, mask="bool")) == {}  # CUDA: exact records only


def test_decode_candidates_and_records():
    from tvmflash.tuning import tuned_knobs

    cands = tune.candidates(AttentionSpec("bfloat16", 128, kv_cache=True), "decode")
    assert cands and all(set(c) == {"decode_block_n", "decode_stages", "decode_l2_prefetch"} for c in cands)
    assert all((16 + 2 * c["decode_stages"] * c["decode_block_n"]) * (128 + 8) * 2 <= tune.SMEM_LIMIT for c in cands)
    # a causal / windowed decode spec takes the plain decode record (tuning_logs/cuda/knobs.json has it)
    plain = tuned_knobs("cuda", AttentionSpec("bfloat16", 128, kv_cache=True))
    assert "decode_ctas_per_sm" in plain
    assert tuned_knobs("cuda", AttentionSpec("bfloat16", 128, "bottom_right", variants=("window",), kv_cache=True)) == plain
