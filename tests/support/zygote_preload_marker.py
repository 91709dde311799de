"""Stands in for the ranks' preload in tests/support/rank_zygote_probe.py: records which process
imported it."""

import os

IMPORTED_BY = os.getpid()
