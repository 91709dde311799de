"""`python -m tether.bench.engines.slow_engine`: the CPU engine with a seeded per-request delay.

For benchmarks and tests only: each request waits a random delay before it joins the batch, to
imitate the long tail of real engines. Takes every flag of `tether engine` plus `--delay-*`.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field

from tether.rollout import cpu_engine
from tether.runtime.errors import ConfigError

DISTRIBUTIONS = ("none", "constant", "exponential", "lognormal")


@dataclass
class DelaySampler:
    """Draws one request's delay in seconds; the same seed draws the same delays."""

    distribution: str
    mean_s: float
    sigma: float = 1.0
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def __call__(self) -> float:
        if self.distribution == "none" or self.mean_s <= 0:
            return 0.0
        if self.distribution == "constant":
            return self.mean_s
        if self.distribution == "exponential":
            return self.rng.expovariate(1.0 / self.mean_s)
        # lognormal with the requested mean: mu = ln(mean) - sigma^2 / 2 (heavy right tail)
        return self.rng.lognormvariate(math.log(self.mean_s) - self.sigma**2 / 2, self.sigma)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cpu_engine.add_arguments(parser)
    parser.add_argument(
        "--delay-distribution", choices=DISTRIBUTIONS, default="none", help="Delay distribution."
    )
    parser.add_argument("--delay-mean-ms", type=float, default=0.0, help="Mean delay (ms).")
    parser.add_argument("--delay-sigma", type=float, default=1.0, help="Lognormal sigma.")
    parser.add_argument("--delay-seed", type=int, default=0, help="Delay RNG seed.")


def delay_argv(distribution: str, mean_ms: float, sigma: float = 1.0, seed: int = 0) -> list[str]:
    """The command-line tail that asks this module for a delay."""
    return [
        "--delay-distribution", distribution, "--delay-mean-ms", str(mean_ms),
        "--delay-sigma", str(sigma), "--delay-seed", str(seed),
    ]  # fmt: skip


def main(args: argparse.Namespace) -> int:
    for flag, value in (("--delay-mean-ms", args.delay_mean_ms), ("--delay-sigma", args.delay_sigma)):
        if value < 0:
            raise ConfigError(flag, value, "must be >= 0")
    sampler = DelaySampler(
        args.delay_distribution, args.delay_mean_ms / 1000.0, args.delay_sigma, args.delay_seed
    )
    return cpu_engine.main(args, delay=sampler)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tether.bench.engines.slow_engine", description=__doc__)
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
