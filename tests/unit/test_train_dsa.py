"""DeepSeek sparse attention on the trainer (tether.train.model.families.dsa, hf_config's index_*
fields): what the HF configs of GLM-5 and DeepSeek-V3.2 say, the indexer's weight layout between HF
and slime's Megatron checkpoints, --freeze-indexer's parameters, the shared layers' choice book, the
pipeline split refused where a stage would start on a shared layer, and --allgather-cp's layout.
Logits, round trips, layouts and training: tests/integration/test_train_model.py (glm_moe_dsa,
deepseek_v32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.runtime.errors import ConfigError
from tether.train.model.families import dsa
from tether.train.model.hf_config import check_mtp_layers, check_parallel, load_arch
from tether.train.parallel import context


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsa")
    return {
        arch: write_tiny_model(root / arch, TinyModelSpec(arch=arch, layers=4, bpe_merges=0))  # type: ignore[arg-type]
        for arch in ("glm_moe_dsa", "deepseek_v32")
    }


def _with_config(src: Path, tmp_path: Path, **changes: object) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_the_indexer_is_read_from_the_hf_config(models: dict[str, Path]) -> None:
    glm, v32 = load_arch(models["glm_moe_dsa"]), load_arch(models["deepseek_v32"])
    assert glm.multi_latent_attention and glm.is_moe and glm.moe_layer_freq == (0, 1, 1, 1)
    assert (glm.index_heads, glm.index_topk, glm.index_rope_interleaved) == (16, 4, True)
    assert glm.index_shared == (False, True, False, True)  # transformers' indexer_types
    assert (v32.index_rope_interleaved, v32.index_shared) == (False, (False,) * 4)
    assert glm.index_head_dim is not None and glm.index_head_dim > (glm.qk_pos_emb_head_dim or 0)


@pytest.mark.parametrize(
    ("changes", "field", "why"),
    [
        ({"index_head_dim": 8}, "index_head_dim", "must exceed qk_rope_head_dim"),
        ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types", "no earlier indexer"),
        ({"indexer_types": ["full"]}, "indexer_types", "for each of the 4 layers"),
    ],
)
def test_indexer_configs_tether_cannot_build_are_refused(
    models: dict[str, Path], tmp_path: Path, changes: dict[str, object], field: str, why: str
) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        load_arch(_with_config(models["glm_moe_dsa"], tmp_path, **changes))
    assert err.value.key.endswith(f":{field}")


def test_glm5_schedules_read_as_transformers_reads_them(models: dict[str, Path], tmp_path: Path) -> None:
    from transformers import GlmMoeDsaConfig

    for keys in (
        {"index_topk_freq": 4, "index_skip_topk_offset": 3},  # GLM-5.2: layers 0, 1, 2, 6 compute
        {"index_topk_pattern": "FSFF"},
        {},
    ):
        unset = {"indexer_types": None, "index_topk_freq": None, "index_skip_topk_offset": 2}
        path = _with_config(models["glm_moe_dsa"], tmp_path, **{**unset, **keys})
        want = GlmMoeDsaConfig(num_hidden_layers=4, **keys).indexer_types  # type: ignore[arg-type]
        assert [("shared" if s else "full") for s in load_arch(path).index_shared or ()] == want


def test_a_pipeline_stage_may_not_start_on_a_shared_layer(models: dict[str, Path]) -> None:
    glm = load_arch(models["glm_moe_dsa"])  # full, shared, full, shared
    check_parallel(glm, 1, 2)  # stages start at layers 0 and 2
    with pytest.raises(ConfigError, match="reuses an earlier layer's sparse-attention choice") as err:
        check_parallel(glm, 1, 2, first_stage_layers=1)
    assert err.value.key == "--pipeline-model-parallel-size"
    with pytest.raises(ValueError, match="starting at layer 2 would begin"):
        dsa.check_stage_starts(dsa.SparseIndexer.of(glm), 2)  # type: ignore[arg-type]


def test_mtp_layers_of_sparse_attention_models_are_not_built(models: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="sparse-attention model"):
        check_mtp_layers(load_arch(models["deepseek_v32"]), 1)


def test_the_indexer_rope_rows_move_between_hf_and_megatron() -> None:
    # slime's converter (megatron_to_hf/deepseekv3.py) rotates each head's 128 rows by 64: HF holds
    # the RoPE dims first, slime's Megatron layout last.
    hf = torch.arange(2 * 128 * 3, dtype=torch.float32).reshape(256, 3)
    mcore = dsa._rope_rows(hf, 128, 64, to_mcore=True)
    heads = hf.reshape(2, 128, 3)
    assert torch.equal(mcore.reshape(2, 128, 3), torch.cat([heads[:, 64:], heads[:, :64]], dim=1))
    assert torch.equal(dsa._rope_rows(mcore, 128, 64, to_mcore=False), hf)
    norm = torch.arange(16.0)  # k_norm: one head of 16 with 4 RoPE dims
    assert dsa._rope_rows(norm, 16, 4, to_mcore=True).tolist() == [*range(4, 16), *range(4)]


def test_freeze_indexer_finds_slimes_and_megatrons_indexer_names() -> None:
    names = {
        "decoder.layers.0.self_attention.wq_b.weight": True,
        "decoder.layers.0.self_attention.k_norm.bias": True,
        "decoder.layers.1.self_attention.core_attention.indexer.linear_wq_b.weight": True,
        "decoder.layers.0.self_attention.linear_q_down_proj.weight": False,
        "decoder.layers.0.mlp.experts.wk.weight": False,
    }
    assert {n: dsa.is_indexer_parameter(n) for n in names} == names

    class Layer(torch.nn.Module):
        def __init__(self, indexer: bool) -> None:
            super().__init__()
            self.self_attention = torch.nn.Module()
            self.self_attention.linear_proj = torch.nn.Linear(2, 2)
            if indexer:
                self.self_attention.wk = torch.nn.Linear(2, 2)

    layer = Layer(indexer=True)
    assert dsa.freeze_indexers(layer) == ["self_attention.wk.weight", "self_attention.wk.bias"]
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == [
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj.bias",
    ]
    with pytest.raises(ValueError, match=r"--freeze-indexer: .* no DeepSeek sparse-attention indexer"):
        dsa.freeze_indexers(Layer(indexer=False))


def test_a_shared_layer_finds_its_choice_through_a_detached_mask() -> None:
    # Megatron's activation recompute hands the layers a detached copy of the mask (a new tensor on
    # the same storage): the book still finds the computing layer's choice; another mask does not.
    book = dsa.ChoiceBook(keep=2)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    chosen = torch.tensor([[[0], [1], [2], [3]]])
    book.put(mask, 1, chosen)
    assert book.get(mask.detach(), 1, asking=2) is chosen
    with pytest.raises(RuntimeError, match="layer 2 reuses layer 1's chosen keys"):
        book.get(torch.ones(1, 1, 4, 4, dtype=torch.bool), 1, asking=2)
    for _ in range(2):  # only the latest masks' choices are kept
        book.put(torch.zeros(1, 1, 4, 4, dtype=torch.bool), 1, chosen)
    with pytest.raises(RuntimeError):
        book.get(mask, 1, asking=2)


def test_allgather_cp_gives_each_rank_a_contiguous_share() -> None:
    zigzag = [context.CPLayout(2, r, None).positions(8).tolist() for r in range(2)]
    shares = [context.CPLayout(2, r, None, contiguous=True).positions(8).tolist() for r in range(2)]
    assert zigzag == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert shares == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert context._global_order(4, 2, True).tolist() == list(range(8))
