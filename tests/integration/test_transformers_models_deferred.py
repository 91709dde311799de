"""transformers.models deferred (tether.runtime.process.deferred_package): the head's tokenizer
and a rank's model config load with that model's modules alone, the same tokenizer and config
as without it; anything else asked of the package completes it. Fresh interpreters: the test
process has imported all of transformers long before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tether.runtime.files.cache_dir import CACHE_ENV

_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
from tether.runtime.process.deferred_package import is_deferred
model = sys.argv[1]
out = {}
if sys.argv[2] == "rank":
    import torch
    import tether.train.rank.preload  # the rank zygote's imports
    from tether.train.model.bridge import hf_config, open_bridge, parallel_states
    from tether.train.model.hf_config import load_arch
    cfg = hf_config(model)
    bridge = open_bridge(load_arch(model), cfg, dtype=torch.float32, parallel=parallel_states(tp_size=1, pp_size=1))
    out["config"] = type(cfg).__name__
    out["megatron"] = {k: v for k, v in sorted(bridge.config.items()) if isinstance(v, (int, float, str, bool))}
else:
    from tether.rollout.data.source import load_tokenizer
    tok = load_tokenizer(model)
    out["tokenizer"] = type(tok).__name__
    out["ids"] = tok("hello world, 12 + 7 = 19")["input_ids"]
    out["chat"] = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    out["eos"] = tok.eos_token_id
    out["torch"] = "torch" in sys.modules
out["deferred"] = is_deferred("transformers.models")
out["models_imported"] = sorted({n.split(".")[2] for n in sys.modules if n.startswith("transformers.models.")})
import transformers.utils.import_utils as import_utils
out["table_scans"] = import_utils.create_import_structure_from_path.cache_info().misses
import transformers.models
out["whole"] = "LlamaConfig" in transformers.models.__all__  # the real package's table
out["deferred_after"] = is_deferred("transformers.models")
print(json.dumps(out))
"""


def _run(model: Path, role: str, *, defer: bool, cache: str = "") -> dict:
    # No tokenizer-class cache unless asked (tether.rollout.data.tokenizer_choice): AutoTokenizer runs.
    env = {**os.environ, "TETHER_DEFER_IMPORTS": "1" if defer else "0", CACHE_ENV: cache}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(model), role],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_tokenizer_loads_with_its_model_modules_alone(tiny_model: Path) -> None:
    deferred, eager = _run(tiny_model, "head", defer=True), _run(tiny_model, "head", defer=False)
    assert deferred["deferred"] and not eager["deferred"]
    # The same model modules either way (the tiny model is a llama); the package's __init__,
    # which reads every model's sources, did not run.
    assert {"auto", "llama"} <= set(deferred["models_imported"])
    assert deferred["models_imported"] == eager["models_imported"]
    for key in ("tokenizer", "ids", "chat", "eos"):
        assert deferred[key] == eager[key], key
    assert deferred["whole"] and eager["whole"] and not deferred["deferred_after"]


def test_a_rank_reads_its_config_without_the_package(tiny_model: Path) -> None:
    deferred, eager = _run(tiny_model, "rank", defer=True), _run(tiny_model, "rank", defer=False)
    assert deferred["deferred"] and not eager["deferred"]
    assert deferred["config"] == eager["config"] == "LlamaConfig"
    # TETHER_DEFER_IMPORTS=0 imports all of mbridge too, whose VL bridges import their models'
    assert set(deferred["models_imported"]) < set(eager["models_imported"])
    assert deferred["megatron"] == eager["megatron"] and deferred["megatron"]["num_layers"] > 0
    assert deferred["whole"] and not deferred["deferred_after"]


def test_a_remembered_tokenizer_class_loads_without_torch_or_the_models_config(
    tiny_model: Path, tmp_path: Path
) -> None:
    cache = str(tmp_path / "cache")
    miss = _run(tiny_model, "head", defer=True, cache=cache)  # AutoTokenizer, its class recorded
    hit = _run(tiny_model, "head", defer=True, cache=cache)
    assert miss["torch"] and "llama" in miss["models_imported"]
    # AutoConfig never ran: no model's modules, and no torch (AutoTokenizer's import brings it).
    assert not hit["torch"] and hit["models_imported"] == []
    # transformers' own table of the models' names, read back, not rebuilt from their sources
    # (tether.runtime.process.transformers_table)
    assert miss["table_scans"] > 100 and hit["table_scans"] == 0
    for key in ("tokenizer", "ids", "chat", "eos"):
        assert hit[key] == miss[key], key
