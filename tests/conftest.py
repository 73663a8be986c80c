import os

import torch

from attnperf.testing import initialize_mkl_vml

# Triton runs on CPU only through its interpreter, which must be chosen before the
# kernels are imported (attnperf imports them lazily, on first use).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A reference's torch.exp must not be VML's first call from two threads at once.
initialize_mkl_vml()
