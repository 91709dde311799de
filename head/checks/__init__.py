"""Checks of the flags before anything starts: the critic's, slime's loss hooks, slime flags refused.
May import the components (config slices, hook checks); never tether.config, which runs these checks."""
