"""`python -m tether.rollout.cpu_engine`: serve a model with the embedded CPU engine."""

import argparse
import sys

from tether.rollout.cpu_engine.server import add_arguments, main
from tether.runtime.errors import exit_on_user_error

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tether.rollout.cpu_engine", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args()
    # As `tether engine`: a bad flag or model directory is one line in the engine's log.
    sys.exit(exit_on_user_error("tether engine", lambda: main(args)))
