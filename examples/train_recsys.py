"""Moved: the example model ships with the package as :mod:`elastic_emb.examples.recsys`.

This file stays so that existing commands and images that name ``examples/train_recsys.py`` keep
working; it runs the packaged module. New commands should use ``-m elastic_emb.examples.recsys``
or the path ``elastic-emb example-path`` prints.
"""

import sys

from elastic_emb.examples.recsys import *  # noqa: F401,F403 - the drills' replay imports this file's functions
from elastic_emb.examples.recsys import main

if __name__ == "__main__":
    sys.exit(main())
