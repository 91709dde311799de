"""The PPO critic's value head: the last stage's output layer (the vocabulary projection) replaced
by a linear map to one value per position, freshly initialised (normal with the config's
init_method_std, zero bias) as slime does whenever the loaded weights hold no value head.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.train.model.megatron_cpu import quiet_megatron_imports


class ValueHead(torch.nn.Linear):
    """hidden -> 1, called as GPTModel calls its output layer (`weight=` and `runtime_gather_output=`
    are the vocabulary projection's and do not apply). The weight is replicated on every TP rank;
    under sequence parallelism the values are gathered back to the full sequence."""

    def __init__(self, hidden_size: int, config: Any, *, seed: int) -> None:
        super().__init__(hidden_size, 1, bias=True, dtype=config.params_dtype)
        self.sequence_parallel = bool(config.sequence_parallel)
        if self.sequence_parallel:
            # Megatron all-reduces the grads of sequence-parallel replicated weights over TP.
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]
        std = getattr(config, "init_method_std", None) or 0.02
        # The same seed on every rank: TP ranks hold one replicated head (DP is broadcast anyway).
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * std)
            self.bias.zero_()

    def forward(  # type: ignore[override]
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        del weight, runtime_gather_output
        values = super().forward(input_).float()
        if self.sequence_parallel:
            with quiet_megatron_imports():
                from megatron.core import tensor_parallel

            values = tensor_parallel.gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False
            )
        return values, None


def attach_value_head(chunk: Any, config: Any, *, seed: int) -> bool:
    """Replace the last stage's output layer of an (unwrapped) GPTModel by a ValueHead; False on
    a stage without one. A tied output layer stops using the embedding: the head has its own weight."""
    if getattr(chunk, "output_layer", None) is None or not getattr(chunk, "post_process", True):
        return False
    head = ValueHead(config.hidden_size, config, seed=seed)
    if torch.cuda.is_available():
        head = head.cuda(torch.cuda.current_device())
    chunk.output_layer = head
    if getattr(chunk, "share_embeddings_and_output_weights", False):
        if not getattr(chunk, "pre_process", True):
            # The last stage's copy of the embedding exists only for the tied projection, and its
            # grads are all-reduced with stage 0's: that coupling has no meaning for a value head.
            raise ValueError(
                "a critic of a model with tied embeddings under pipeline parallelism is not supported"
            )
        chunk.share_embeddings_and_output_weights = False
    return True


__all__ = ["ValueHead", "attach_value_head"]
