"""`python -m tether.rollout.cpu_engine`: serve a model with the embedded CPU engine."""

import argparse
import sys

from tether.rollout.cpu_engine.server import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tether.rollout.cpu_engine", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
