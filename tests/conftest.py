import os
import sys

import torch

# Forked ranks inherit this process; keep its intra-op pool single-threaded so that
# forking after torch work is safe and ranks do not oversubscribe the cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
