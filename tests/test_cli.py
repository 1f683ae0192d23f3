"""The command line: `tvmflash info`, `bench` (a tiny grid) and `plot`; `tune`, `build` and
`export` are in test_tune.py and test_deploy.py."""
import json

from typer.testing import CliRunner

from tvmflash.cli import app


def test_info_shows_targets_cache_records_and_presets():
    result = CliRunner().invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    for part in ("cpu target", "module cache", "tuning records", "avx512", "llama3-8b", "compiler"):
        assert part in result.output


def test_bench_writes_results_and_plot(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--dtype", "fp32", "--seqlen", "64", "--head-dim", "16", "--heads", "2",
                                      "--rounds", "1", "--iters", "1", "--out", str(tmp_path), "--tag", "t"])
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "t.json").read_text())
    assert results["machine"]["steady_heap"] is True  # glibc: the heap thresholds are fixed first
    rows = results["rows"]
    assert len(rows) == 1 and rows[0]["timings"]["ours"]["fwd_ms"] > 0 and rows[0]["ratio"]["torch"]["bwd"] > 0
    assert rows[0]["fwd_max_abs_diff"] < 1e-5
    assert (tmp_path / "t.png").stat().st_size > 0
    (tmp_path / "t.png").unlink()
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "t.json")])
    assert result.exit_code == 0 and (tmp_path / "t.png").exists()


def test_cuda_result_files_are_named_by_the_gpu(monkeypatch):
    from tvmflash import bench

    for name, tag in (("NVIDIA H200", "cuda-h200"), ("NVIDIA H100 80GB HBM3", "cuda-h100"), ("NVIDIA", "cuda-gpu")):
        monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert bench.cuda_tag() == tag


def test_build_fills_the_cache():
    from tvmflash import build
    from tvmflash.spec import AttentionSpec

    result = CliRunner().invoke(app, ["build", "--target", "avx512", "--spec", "fp32:d16"])
    assert result.exit_code == 0, result.output
    assert build.library_path(AttentionSpec("float32", 16), build.AVX512_TARGET).exists()


def test_build_a_model_preset():
    from tvmflash import build
    from tvmflash.presets import MODEL_PRESETS

    result = CliRunner().invoke(app, ["build", "--target", "avx512", "--model-preset", "llama3-8b", "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    for spec in MODEL_PRESETS["llama3-8b"].specs("float32"):
        assert build.library_path(spec, build.AVX512_TARGET).exists()
