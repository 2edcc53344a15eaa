import os
import sys

import torch

# Test models are tiny: one thread is as fast, and it cannot oversubscribe the 2-core CI
# machine while spawned ranks (one thread each) run beside the main process.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))


def pytest_sessionfinish(session, exitstatus):
    """The warm ranks of tests/multirank.py end with the session."""
    mod = sys.modules.get("multirank")
    if mod is not None:
        mod.shutdown()
