"""`python -m specdec.train` (e.g. under torchrun): the same arguments as `specdec train`."""

import sys

from specdec.train.cli import main

sys.exit(main())
