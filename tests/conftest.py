import os
import sys

# Ask NVML, not the CUDA runtime, whether a GPU is there: the runtime's check "poisons" fork,
# and the harness forks ranks that then use CUDA themselves.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # noqa: E402

# Forked ranks inherit this process; keep its intra-op pool single-threaded so that
# forking after torch work is safe and ranks do not oversubscribe the cores.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))
