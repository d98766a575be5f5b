"""End-to-end example: a byte-level MoE language model trained in MXFP8 and in BF16.

``python -m train_example.train`` trains one precision; ``python -m train_example.parity`` trains
both from the same seed and data and checks that MXFP8 matches BF16's loss curve.
"""

import os
import sys

# The CPU runs are thousands of small ops per step, each an OpenMP parallel region. With the
# OpenMP runtime's default (spinning) wait, a core shared with other jobs makes every region wait
# for a descheduled spinner: on a 2-core machine at load 11-13 the MXFP8 step took > 16 s with 2
# threads vs 1.74 s with passive waiting (on idle cores passive costs ~15%: 0.35 vs 0.30 s). The
# policy is read when torch loads OpenMP, so it can only be set here, before the commands import
# torch; a value already set (OMP_WAIT_POLICY=ACTIVE) wins.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
