"""`python -m tether.commands.warm_caches`: fill tether's start-up caches once, at install time
(`bin/setup` runs it last), so that the first `tether demo` starts as fast as the later ones.

Two caches in `$TETHER_CACHE_DIR` (default `~/.cache/tether`; empty turns them off) save CPU at
every start, but are built by the first run that misses them, which then pays for it:
- transformers' table of its models' exported names (`tether.runtime.process.transformers_table`),
  ~0.3 CPU-seconds in every process that imports transformers (the head, the rank zygote);
- the tokenizer class AutoTokenizer picks for a model directory's files
  (`tether.rollout.data.tokenizer_choice`): a miss goes through AutoConfig, which imports
  transformers' modelling utilities and torch into the head (~2 CPU-seconds more).
Here both are filled for this environment's transformers and for the demo's model, whose
tokenizer files are the same whatever its seed (only its weights differ, which the key leaves
out), so `tether demo` and `tether bench e2e` hit them from their first run.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tether.runtime.files.cache_dir import cache_dir


def warm() -> list[str]:
    """Fill both caches; returns those that now hold this environment's entry, as read back
    (nothing where the cache is off; an editable transformers is never cached)."""
    from tether.runtime.process import transformers_table

    if cache_dir() is None:
        return []
    transformers_table.remember_transformers_table()  # before anything below imports transformers
    import transformers

    from tether.commands.demo import make_model
    from tether.rollout.data.tokenizer_choice import load_tokenizer, remembered

    filled = []
    with tempfile.TemporaryDirectory(prefix="tether-warm-") as tmp:
        model = str(make_model(Path(tmp), seed=1))
        load_tokenizer(model)
        key = transformers_table.install_key(Path(transformers.__file__).parent)
        if key is not None and transformers_table.remembered(key) is not None:
            filled.append("transformers' name table")
        if remembered(model, str(transformers.__version__)) is not None:
            filled.append("the demo model's tokenizer class")
    return filled


def main() -> int:
    filled = warm()
    where = cache_dir()
    if where is None:
        print("start-up caches off (TETHER_CACHE_DIR is empty): nothing warmed", flush=True)
    else:
        print(
            f"start-up caches warmed in {where}: {', '.join(filled) or 'nothing this environment can keep'}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
