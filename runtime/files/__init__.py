"""Files written and read safely: atomic writes, joining names read from metadata to a folder.
May import tether.runtime.errors only."""
