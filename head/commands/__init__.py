"""The `tether` subcommands (run, plan, convert, demo, plot, version), imported by the CLI when used.
May import the rest of the head (tether.config, .run, .records, .checks) and every component."""
