"""The CUDA tuner's bookkeeping (the timing itself runs on the GPU machine)."""
import json

from tvmflash import tune_cuda
from tvmflash.spec import AttentionSpec


def test_candidates_respect_shared_memory_and_registers():
    for d in (64, 128, 256):
        for knobs in tune_cuda.candidates(AttentionSpec("float16", d)):
            assert (knobs["block_m"] + 2 * knobs["stages"] * knobs["block_n"]) * (d + 8) * 2 <= tune_cuda.SMEM_LIMIT
            assert not (knobs["q_in_registers"] and d > 128)
            assert knobs["warp_m_tiles"] == 1 or d <= 128
    assert len(tune_cuda.candidates(AttentionSpec("float16", 64))) == 40  # (12 one-tile + 8 two-tile) x 2 rings


def test_record_keeps_the_fastest_candidate_per_spec(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setattr(tune_cuda, "TUNING_LOGS_DIR", logs)
    (logs / "cuda").mkdir(parents=True)
    (logs / "cuda" / "knobs.json").write_text(json.dumps({"other_spec": {"block_m": 64}}))
    spec = AttentionSpec("float16", 64)
    timings = [{"spec": spec.to_dict(), "knobs": {"block_m": bm}, "ms": ms, "tflops": 1.0}
               for bm, ms in ((64, 2.0), (128, 1.5), (32, 3.0))]
    (tmp_path / "timings.json").write_text(json.dumps(timings))
    tune_cuda.record(tmp_path)
    records = json.loads((logs / "cuda" / "knobs.json").read_text())
    assert records == {"other_spec": {"block_m": 64}, spec.name: {"block_m": 128}}


def test_record_merges_forward_and_backward_phases(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    monkeypatch.setattr(tune_cuda, "TUNING_LOGS_DIR", logs)
    spec = AttentionSpec("bfloat16", 128, causal="top_left")
    timings = [{"spec": spec.to_dict(), "phase": "forward", "knobs": {"block_m": 64}, "ms": 1.0, "tflops": 1.0},
               {"spec": spec.to_dict(), "phase": "backward", "knobs": {"bwd_block_n": 128, "bwd_block_m": 64},
                "ms": 3.0, "tflops": 1.0},
               {"spec": spec.to_dict(), "phase": "backward", "knobs": {"bwd_block_n": 64, "bwd_block_m": 32},
                "ms": 2.5, "tflops": 1.0}]
    (tmp_path / "timings.json").write_text(json.dumps(timings))
    tune_cuda.record(tmp_path)
    records = json.loads((logs / "cuda" / "knobs.json").read_text())
    assert records == {spec.name: {"block_m": 64, "bwd_block_n": 64, "bwd_block_m": 32}}


def test_backward_candidates_fit_shared_memory():
    for d in (64, 128, 256):
        cands = tune_cuda.candidates(AttentionSpec("float16", d), "backward")
        assert cands and all(set(c) == {"bwd_block_n", "bwd_block_m", "bwd_stages", "bwd_d_split"} for c in cands)
        assert all((c["bwd_d_split"] == 2) == (d > 128) for c in cands)
