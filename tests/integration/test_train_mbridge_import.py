"""mbridge imported one family at a time, in a fresh interpreter (the test process has imported
all of mbridge long before): a family's bridge module alone, then the whole package on demand."""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = """
import json, sys, warnings
warnings.simplefilter("ignore")
from tether.train.model.bridge import _bridge_class, parallel_states
from tether.train.model.mbridge_import import family_modules

out = {"families": dict(family_modules())}
llama = _bridge_class("llama")
from mbridge.core.bridge import _MODEL_REGISTRY
parallel_states(tp_size=1, pp_size=1)
out["llama"] = llama.__name__
out["after_llama"] = sorted(_MODEL_REGISTRY)
out["vl_imported"] = "mbridge.models.glm4_vl" in sys.modules
out["kimi"] = _bridge_class("kimi_k2").__name__  # an MLA family: DeepSeek-V3's module only
out["after_kimi"] = sorted(_MODEL_REGISTRY)
out["glm4"] = _bridge_class("glm4").__name__  # tether's own: nothing of mbridge's registry added
out["after_glm4"] = sorted(_MODEL_REGISTRY)
# GLM-4.5's bridge imports its bases from the package mid-import: their modules alone
out["glm4_moe"] = _bridge_class("glm4_moe").__name__
out["after_glm4_moe"] = sorted(_MODEL_REGISTRY)
out["vl_imported_later"] = "mbridge.models.glm4_vl" in sys.modules
out["unknown"] = _bridge_class("no_such_family")  # not in the sources: all of mbridge, then None
import mbridge
out["auto_bridge"] = mbridge.AutoBridge.__name__
from mbridge.models import Qwen3MoEBridge
out["qwen3_moe"] = Qwen3MoEBridge.__name__
out["after_all"] = sorted(_MODEL_REGISTRY)
print(json.dumps(out))
"""


def test_a_family_imports_its_own_bridge_and_the_package_completes_on_demand() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    families = out["families"]
    assert families["llama"] == "mbridge.models.llama"
    assert families["glm4v"] == families["glm4v_moe"] == "mbridge.models.glm4_vl"
    assert out["llama"] == "LLaMABridge" and out["after_llama"] == ["llama"]
    assert not out["vl_imported"]
    assert out["kimi"] == "DeepseekV3Bridge" and out["after_kimi"] == ["deepseek_v3", "llama"]
    assert out["after_glm4"] == ["deepseek_v3", "llama", "qwen2"]  # tether's glm4 bridge is Qwen2's
    assert out["glm4_moe"] == "GLM4MoEBridge" and not out["vl_imported_later"]
    assert out["after_glm4_moe"] == ["deepseek_v3", "glm4_moe", "llama", "qwen2", "qwen2_moe"]
    assert out["unknown"] is None
    assert (out["auto_bridge"], out["qwen3_moe"]) == ("AutoBridge", "Qwen3MoEBridge")
    # the sources name every family mbridge registers once all of it is imported
    assert sorted(families) == out["after_all"]
