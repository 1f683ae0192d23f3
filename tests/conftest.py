import os
import sys
import tempfile
from pathlib import Path

# One kernel cache per test run, shared by every test and subprocess (and by pytest-xdist's
# workers, which inherit it from the controller that loads this file first): each spec builds once.
os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmflash-test-cache-"))
os.environ.setdefault("TVMFLASH_QUIET", "1")
# pytest-xdist's workers (`-n auto`, one a core) build specs side by side already: a module's
# kernels split over more processes there only repeat their generation (whole suite, 2 cores:
# 36.3 min against 33.4). `tests/test_cache.py` builds in parts itself.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TVMFLASH_BUILD_JOBS", "1")
# The suite's CPU tests run the host (AVX2) path wherever they run: on an AMX CPU `auto` would
# take the sapphirerapids modules (1.5-3x the host modules' build time) and leave the host
# path untested. tests/test_avx512.py pins its own targets (AMX, pair dots) per test;
# TVMFLASH_CPU_TARGET=auto runs the whole suite on the CPU's own path instead.
os.environ.setdefault("TVMFLASH_CPU_TARGET", "host")
sys.path.insert(0, str(Path(__file__).parent))
