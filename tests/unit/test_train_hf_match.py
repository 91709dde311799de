"""Whether the actor's exported tensors are exactly an HF checkpoint's
(tether.train.checkpoint.hf_match): compared at the wider of the two dtypes, so that equal
there means a weight sync would change nothing in any dtype an engine holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tether.train.checkpoint.hf_match import compare_with_hf, first_difference, tensor_difference
from tether.train.model.hf_convert import HFWeights


@pytest.fixture
def hf(tmp_path: Path) -> HFWeights:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w_bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "w_fp32": torch.randn(5, generator=g),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return HFWeights(tmp_path)


def test_equal_values_match_across_dtypes(hf: HFWeights) -> None:
    bf16 = hf.get("w_bf16")
    assert tensor_difference("w_bf16", bf16.clone(), hf) is None
    assert tensor_difference("w_bf16", bf16.float(), hf) is None  # fp32 master of bf16 values
    assert tensor_difference("w_fp32", hf.get("w_fp32").clone(), hf) is None


def test_a_narrower_copy_of_wider_values_is_not_a_match(hf: HFWeights) -> None:
    # A bf16 actor from an fp32 checkpoint: an fp32 engine would get other values after a sync.
    found = tensor_difference("w_fp32", hf.get("w_fp32").to(torch.bfloat16), hf)
    assert found is not None and found.startswith("w_fp32: values differ")


def test_each_kind_of_difference_is_named(hf: HFWeights) -> None:
    bf16 = hf.get("w_bf16")
    assert "not in" in str(tensor_difference("w_other", bf16, hf))
    assert str(tensor_difference("w_bf16", bf16.reshape(3, 4), hf)).startswith(
        "w_bf16: shape (3, 4) here, (4, 3) in"
    )
    changed = bf16.float().clone()
    changed[1, 2] += 0.5
    assert "max |difference| 0.5" in str(tensor_difference("w_bf16", changed, hf))
    nan = bf16.float().clone()
    nan[0, 0] = float("nan")
    assert "max |difference| inf" in str(tensor_difference("w_bf16", nan, hf))


def test_the_export_is_iterated_to_its_end_after_a_difference(hf: HFWeights) -> None:
    taken: list[str] = []

    def exported():  # type: ignore[no-untyped-def]
        for name, tensor in [("w_fp32", hf.get("w_fp32") + 1), ("w_bf16", hf.get("w_bf16"))]:
            taken.append(name)
            yield name, tensor

    result = first_difference(exported(), hf)
    assert result.compared == 1 and str(result.difference).startswith("w_fp32: values differ")
    assert taken == ["w_fp32", "w_bf16"]  # the TP gathers behind it are collectives
    taken.clear()
    assert first_difference(exported(), None).compared == 0 and taken == ["w_fp32", "w_bf16"]


def test_an_unreadable_checkpoint_is_a_difference_not_an_error(
    hf: HFWeights, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exported = [("w_fp32", hf.get("w_fp32"))]
    monkeypatch.setattr(
        "tether.train.checkpoint.hf_match.iter_hf_weights", lambda chunks, arch: iter(exported)
    )
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    result = compare_with_hf([], None, str(bin_only), compare=True)  # type: ignore[arg-type]
    assert result.compared == 0 and str(result.difference).startswith(
        f"cannot read {bin_only} as safetensors"
    )
    assert compare_with_hf([], None, str(hf.dir), compare=True).difference is None  # type: ignore[arg-type]
    (hf.dir / "model.safetensors").write_bytes(b"truncated")  # listed before, unreadable now
    found = first_difference(iter(exported), hf)
    assert found.compared == 1 and str(found.difference).startswith("w_fp32: cannot read it from")
