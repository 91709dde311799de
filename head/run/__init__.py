"""One run's machinery: the job and its steps, loops, trainer and engine pools, rollout manager, ports.
May import tether.config, tether.records, tether.checks and every component; never tether.commands."""
