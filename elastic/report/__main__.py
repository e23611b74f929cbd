"""`python -m elastic.report LOG -o run.png`: a picture of a run from its event log."""

import sys

from elastic._shared.common.cli import run_main
from elastic.report import main

sys.exit(run_main(main))
