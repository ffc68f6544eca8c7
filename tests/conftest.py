"""Test set-up: offline, tiny models, a private cache per session, deterministic CPU threads."""

import os
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("DSCHAT_CACHE", tempfile.mkdtemp(prefix="dschat-test-cache-"))

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


import pytest  # noqa: E402


@pytest.fixture
def ctrl_c():
    """Ctrl-C's default disposition in this process for one test, whatever pytest was started with: a suite run in
    the background (`cmd &`, nohup) has SIGINT ignored, and dschat leaves an ignored SIGINT ignored."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
