"""Scale simulation: one training step's predicted communication from 1 to 1024 GPUs.

    python tools/simulate.py OUT.pb [--devices-per-worker 8] [--ps N] [--gpus 1,2,4,...]
    python tools/simulate.py PLAN.json ...           (a plan `graph-rewrite plan` printed)
    python tools/simulate.py --model resnet50 [--strategy allreduce|ps|hybrid] [--png scale.png] [--json]
    python tools/simulate.py --validate [--validate-workers 2,3] [--steps 20] [--rounds 3]

The command line of graph_rewriter.simulate, where the logic and its documentation live
(``--help`` lists every flag).
"""

import sys

from graph_rewriter.simulate import main

if __name__ == "__main__":
    sys.exit(main())
