"""Exported modules: compiled libraries plus a manifest, for deployments with TVM's runtime only.

    tvmflash export --target cuda --model-preset llama3-8b --out modules/   # where the compiler is
    tvmflash.load_exported("modules/")       # or TVMFLASH_EXPORTED=modules/ (os.pathsep-separated)

Then the torch API runs those modules (with `TVM_USE_RUNTIME_LIB=1` TVM imports its runtime
only: no compiler, no LLVM, no nvcc). A call whose spec was not exported builds it where TVM's
compiler is and fails with a clear error where it is not.

`manifest.json` lists per module its file, spec, target, kernels, the TVM version that built
it, the tuned knobs it was built with (and their hash) and the library's sha256; loading checks
every checksum and the TVM version (same major.minor) before anything is used.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from .spec import AttentionSpec

MANIFEST = "manifest.json"
# The kernels' calling convention by target kind, recorded in the manifest: raised when a kernel's
# arguments change, so that modules exported before are refused by name, not by an argument
# count error at their first call (CUDA 1: every forward takes the SM count, `cta_slots`; 2: and
# the `item_counter` its CTAs draw items from; 3: kv_cache modules hold `decode_append`; CPU 1:
# kv_cache modules hold `decode_check` and `decode_append`)
KERNEL_ABI = {"cuda": 3, "llvm": 1}
_exported: dict = {}  # (spec, target kind, target label) -> library path
_env_loaded: set = set()


def _key(spec: AttentionSpec, target: dict) -> tuple:
    from .build import target_label

    return spec, target["kind"], target_label(target)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def export(specs: list, target: dict, out_dir: Path) -> Path:
    """Build (or take from the cache) each spec's module for `target`, copy it to `out_dir`
    and write the manifest (entries of earlier exports to `out_dir` are kept). Returns the
    manifest's path."""
    from .build import _tuning_kind, _tvm, build_cached, kernels_of, target_label
    from .tuning import tuned_knobs

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MANIFEST
    manifest = json.loads(path.read_text()) if path.exists() else {"modules": []}
    entries = {(m["spec_name"], m["target"]["kind"], target_label(m["target"])): m for m in manifest["modules"]}
    for spec in specs:
        if spec.flex:
            raise ValueError(f"{spec.name}: flex_attention specs are not exported (their programs are Python)")
        lib = build_cached(spec, target)
        name = f"{spec.name}-{target_label(target)}.so"
        shutil.copyfile(lib, out_dir / name)
        knobs = tuned_knobs(_tuning_kind(target), spec)
        entries[(spec.name, target["kind"], target_label(target))] = {
            "file": name, "spec_name": spec.name, "spec": spec.to_dict(), "target": target,
            "kernels": list(kernels_of(spec, target)), "kernel_abi": KERNEL_ABI[target["kind"]], "tvm": _tvm().__version__,
            "tuning": knobs, "tuning_sha256": hashlib.sha256(json.dumps(knobs, sort_keys=True).encode()).hexdigest(),
            "sha256": _sha256(out_dir / name), "size": (out_dir / name).stat().st_size}
    from . import __version__

    manifest = {"tvmflash": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "modules": sorted(entries.values(), key=lambda m: m["file"])}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(path)
    return path


def load_exported(directory) -> list[AttentionSpec]:
    """Use the modules exported to `directory` for their specs and targets from now on (this
    process). Checks the manifest first: every library's sha256, and a TVM version this runtime
    runs (same major.minor); raises ValueError naming what does not match. Returns the specs."""
    from .build import _tvm, host_target

    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        raise ValueError(f"{directory} holds no {MANIFEST} (write one with `tvmflash export`)")
    runtime = _tvm().__version__
    found = {}
    for m in json.loads(path.read_text())["modules"]:
        lib = directory / m["file"]
        if m["tvm"].split(".")[:2] != runtime.split(".")[:2]:
            raise ValueError(f"{lib}: built by TVM {m['tvm']}, this runtime is {runtime}")
        abi, calls = m.get("kernel_abi", 0), KERNEL_ABI[m["target"]["kind"]]
        if abi != calls:
            raise ValueError(f"{lib}: exported by a tvmflash whose kernels take other arguments (kernel ABI {abi}, "
                             f"this one calls ABI {calls}): export it again")
        if not lib.exists() or _sha256(lib) != m["sha256"]:
            raise ValueError(f"{lib}: missing, or its sha256 does not match {path}")
        spec = spec_from_dict(m["spec"])
        if spec.name != m["spec_name"]:
            raise ValueError(f"{path}: spec {m['spec_name']} does not describe itself ({spec.name})")
        found[_key(spec, m["target"])] = lib
    _exported.update(found)
    host_target.cache_clear()  # without a compiler, the host target comes from the exports
    return [key[0] for key in found]


def spec_from_dict(fields: dict) -> AttentionSpec:
    """The spec of `AttentionSpec.to_dict()` read back from JSON (lists to tuples)."""
    return AttentionSpec(**{k: tuple(v) if k in ("variants", "flex") else v for k, v in fields.items()})


def _load_env() -> None:
    """Load the directories of TVMFLASH_EXPORTED (os.pathsep-separated) not loaded yet."""
    for directory in filter(None, os.environ.get("TVMFLASH_EXPORTED", "").split(os.pathsep)):
        if directory not in _env_loaded:
            _env_loaded.add(directory)
            load_exported(directory)


def exported_library(spec: AttentionSpec, target: dict) -> Path | None:
    """The exported library of `spec` for `target`, if one was loaded."""
    _load_env()
    return _exported.get(_key(spec, target))


def exported_host_mcpu() -> str | None:
    """The CPU model of exported host-target modules (the runtime-only host target), if any."""
    from .build import AVX512_TARGET

    _load_env()
    models = {label for _, kind, label in _exported if kind == "llvm" and label != AVX512_TARGET["mcpu"]}
    return sorted(models)[0] if models else None
