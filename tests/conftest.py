import os

import torch

# Triton runs on CPU only through its interpreter, which must be chosen before the
# kernels are imported (attnperf imports them lazily, on first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
