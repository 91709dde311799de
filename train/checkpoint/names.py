"""Parameter names of TransformerEngine's layer spec and Megatron's local spec in a checkpoint.

TE fuses some norms into the linear layer that follows them, so the same weight has two names:

    local spec (CPU)                        TransformerEngine spec (GPU clusters)
    input_layernorm.weight                  self_attention.linear_qkv.layer_norm_weight
    pre_mlp_layernorm.weight                mlp.linear_fc1.layer_norm_weight
    self_attention.q_layernorm.weight       self_attention.linear_q_up_proj.layer_norm_weight  (MLA)
    self_attention.kv_layernorm.weight      self_attention.linear_kv_up_proj.layer_norm_weight (MLA)

(megatron-core's dense local spec already maps the first two to TE's names in its sharded state
dict; its MLA and MoE layers and older versions do not.) TE modules also save `_extra_state`
objects (FP8 metadata) that carry no weights. A load asks each tensor under the name the
checkpoint has (`rename_for_checkpoint`); `_extra_state` is asked for only by a TE model, and
only where the checkpoint has it (`tether.train.checkpoint.megatron.extra_state_to_load`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# (local, TE) name pieces; a "_" ending continues into "weight"/"bias".
NORM_ALIASES: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
    ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"),
)
EXTRA_STATE = "_extra_state"


def is_extra_state(key: str) -> bool:
    """A TE/Megatron `_extra_state` entry (no weights; FP8 metadata on TE)."""
    return key.rsplit(".", 1)[-1].startswith(EXTRA_STATE)


def _pieces(key: str) -> tuple[str, str] | None:
    """(prefix up to the layer, rest) of a transformer layer's key, e.g. ("decoder.layers.",
    "input_layernorm.weight") or ("decoder.layers.3.", ...); None for keys outside layers."""
    marker = "layers."
    at = key.find(marker)
    if at < 0:
        return None
    head, rest = key[: at + len(marker)], key[at + len(marker) :]
    number, dot, after = rest.partition(".")
    if dot and number.isdigit():
        head, rest = head + number + ".", after
    inner = "transformer_layer."  # multi-token-prediction layers wrap a transformer layer
    if rest.startswith(inner):
        head, rest = head + inner, rest[len(inner) :]
    return head, rest


def alternative_keys(key: str) -> list[str]:
    """The other names the same tensor has under the other layer spec (may be empty)."""
    split = _pieces(key)
    if split is None:
        return []
    head, rest = split
    out: list[str] = []
    for local, te in NORM_ALIASES:
        for mine, other in ((local, te), (te, local)):
            if rest.startswith(mine):
                out.append(head + other + rest[len(mine) :])
    return out


def rename_for_checkpoint(
    requested: Iterable[str], available: Mapping[str, object] | set[str]
) -> dict[str, str]:
    """For each requested tensor key the checkpoint lacks, the alternative name it has.

    Returns {requested key: checkpoint key} for the renamed ones. Raises KeyError naming every
    requested key found under neither name (`_extra_state` keys are never requested).
    """
    have = set(available)
    renamed: dict[str, str] = {}
    missing: list[str] = []
    for key in requested:
        if key in have:
            continue
        alt = next((a for a in alternative_keys(key) if a in have), None)
        if alt is None:
            missing.append(key)
        else:
            renamed[key] = alt
    if missing:
        sample = sorted(have)[:8]
        raise KeyError(
            f"the checkpoint has no tensor {sorted(missing)[:8]} (nor its TransformerEngine/local-spec "
            f"alias); it holds e.g. {sample}: a different model than --hf-checkpoint describes?"
        )
    return renamed
