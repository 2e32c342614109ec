"""lmforge's tests.

Many tiny models compute side by side here (pytest-xdist workers, kfp.local tasks, torchrun ranks) on few cores, so
each process computes on one thread: OpenMP threads of one process would otherwise spin on cores the others need.
Set before anything imports torch; every subprocess inherits it.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
