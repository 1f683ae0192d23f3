import os
import sys
import tempfile
from pathlib import Path

# One kernel cache per test run, shared by every test and subprocess (and by pytest-xdist's
# workers, which inherit it from the controller that loads this file first): each spec builds once.
os.environ.setdefault("TVMFLASH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmflash-test-cache-"))
os.environ.setdefault("TVMFLASH_QUIET", "1")
sys.path.insert(0, str(Path(__file__).parent))
