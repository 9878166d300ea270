"""The TorchRec example: a DLRM-like model made elastic. It ships with the package as
:mod:`elastic_emb.examples.dlrm` (so ``elastic-emb drill --scenario torchrec`` runs from a
wheel too); this file runs it. Read that module: the model, the build function and the loop.
"""

import sys

from elastic_emb.examples.dlrm import *  # noqa: F401,F403
from elastic_emb.examples.dlrm import main

if __name__ == "__main__":
    sys.exit(main())
