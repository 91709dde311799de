"""slime's hook API on tether: hook files written for slime run here without edits.

Where the real `slime` package is not importable, `import slime.X` resolves to the module of the
same name under this package (`slime.utils.types` is `tether.rollout.slime_api.utils.types`),
through a `sys.meta_path` finder that tether installs when it loads user hooks and in `tether
plan` (see `finder.install`). Where slime is installed it is never shadowed.

The mirrored modules (`utils`, `rollout` and below) keep slime's names and signatures and run
on tether's machinery: the rollout context's router, reward model and data source. The modules
that are tether's own glue are `finder` (the import hook), `convert` (Samples across the
boundary), `args` (slime's flag names on the hooks' `args`) and `bridge` (calling slime-style
rollout functions and buffer filters). Names of slime's API that need Ray exist and raise
`RayRequired` when used.

This package itself is what `import slime` gives; it exports nothing, so that importing it has
no side effects.
"""
