import os
import sys
import tempfile
from pathlib import Path

# One kernel cache per test run, shared by every test and subprocess (and by pytest-xdist's
# workers, which inherit it from the controller that loads this file first): each spec builds once.
os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmflash-test-cache-"))
os.environ.setdefault("TVMFLASH_QUIET", "1")
# The suite's CPU tests run the host (AVX2) path wherever they run: on an AMX CPU `auto` would
# take the sapphirerapids modules (1.5-3x the host modules' build time) and leave the host
# path untested. tests/test_avx512.py pins its own targets (AMX, pair dots) per test;
# TVMFLASH_CPU_TARGET=auto runs the whole suite on the CPU's own path instead.
os.environ.setdefault("TVMFLASH_CPU_TARGET", "host")
sys.path.insert(0, str(Path(__file__).parent))
