import os
import sys

import torch

# Keep the 2-core CI machine responsive: spawned ranks set 1 thread each themselves.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
sys.path.insert(0, os.path.dirname(__file__))
