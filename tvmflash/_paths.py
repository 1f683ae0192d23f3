"""Where schedules/ and tuning_logs/ live: beside the package in a source checkout (the design
card's layout), inside it (tvmflash/schedules, tvmflash/tuning_logs) in an installed wheel."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    inside = PACKAGE_DIR / name
    return inside if inside.is_dir() else PACKAGE_DIR.parent / name


SCHEDULES_DIR = _data_dir("schedules")
TUNING_LOGS_DIR = _data_dir("tuning_logs")


def import_schedules():
    """Import the schedules package as `tvmflash.schedules` from wherever it lives."""
    name = "tvmflash.schedules"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, SCHEDULES_DIR / "__init__.py", submodule_search_locations=[str(SCHEDULES_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
