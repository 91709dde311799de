"""What makes the demo's rollout cheap on the CPU engine, and that none of it changes an answer:
a group's prompts reach the engine in one batched /generate (EngineClient's batch_key), the
engine prefills a prompt shared by several rows once, reads a batch's cache rows in place, and
samples rows without top-k/top-p/min-p without sorting the vocabulary. The engine's HTTP app runs
in this process (aiohttp's test server on loopback); no process is started."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from tokenizers import Tokenizer

from tether.rollout.cpu_engine.http.common import EngineState
from tether.rollout.cpu_engine.http.sglang_api import make_app
from tether.rollout.cpu_engine.modeling.model import KVCache, ModelConfig, TinyLM, read_safetensors_dir
from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.rollout.cpu_engine.sampling import SamplingParams, _draw_unfiltered, choose_tokens
from tether.rollout.cpu_engine.scheduler import Scheduler
from tether.rollout.engine_api.client import EngineClient

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelSpec(seed=5))


def _scheduler(model_dir: Path) -> Scheduler:
    cfg = ModelConfig.from_dir(model_dir)
    return Scheduler(
        cfg,
        TinyLM(cfg, read_safetensors_dir(model_dir)),
        Tokenizer.from_file(str(model_dir / "tokenizer.json")),
        weight_version="v1",
        context_length=256,
        max_running=64,
        original_logprob=False,
        seed=0,
    )


def test_a_groups_requests_are_one_http_call_with_the_answers_of_single_ones(model_dir: Path) -> None:
    prompts = [[5, 17, 3, 99], [5, 17, 3, 99], [42, 7], [5, 17, 3, 99]]
    params = {"max_new_tokens": 6, "temperature": 0.7}

    async def main() -> tuple[list[list[int]], list[list[int]], list[str], int, int]:
        sched = _scheduler(model_dir)
        app = make_app(EngineState(scheduler=sched, model_path=str(model_dir), host="127.0.0.1", port=0))
        calls: list[str] = []

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            calls.append(request.path)
            return await handler(request)

        app.middlewares.append(count)
        server = TestServer(app)
        await server.start_server()
        try:
            async with EngineClient(str(server.make_url("")), retries=0) as client:
                seeded = [{**params, "sampling_seed": 100 + i} for i in range(len(prompts))]
                steps = sched.steps
                batched = await asyncio.gather(
                    *(
                        client.generate(p, sp, rid=f"g-{i}", batch_key="group")
                        for i, (p, sp) in enumerate(zip(prompts, seeded, strict=True))
                    )
                )
                batch_steps = sched.steps - steps
                generate_calls = calls.count("/generate")
                single = [await client.generate(p, sp) for p, sp in zip(prompts, seeded, strict=True)]
        finally:
            await server.close()
        return (
            [r.output_ids for r in batched],
            [r.output_ids for r in single],
            [r.meta_info.id for r in batched],
            generate_calls,
            batch_steps,
        )

    batched, single, rids, generate_calls, batch_steps = asyncio.run(main())
    assert generate_calls == 1  # four prompts, one HTTP exchange
    assert rids == [f"g-{i}" for i in range(4)]  # each prompt keeps its own rid
    assert batched == single  # the same seed gives the same tokens in a batch and alone
    assert all(len(ids) == 6 for ids in batched)
    assert batch_steps == 6  # prefilled together: one model step per new token


def test_a_shared_prompt_is_prefilled_once_with_the_same_logits_and_cache(model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    model = TinyLM(cfg, read_safetensors_dir(model_dir))
    prompts = [[1, 5, 6, 7, 8], [9, 3], [1, 5, 6, 7, 8], [9, 3], [4, 4, 4]]
    shared, alone = KVCache(cfg), KVCache(cfg)
    slots = [shared.allocate(16) for _ in prompts]
    with torch.inference_mode():
        logits = model.prefill(prompts, slots, shared)
        for row, prompt in enumerate(prompts):
            slot = alone.allocate(16)
            ref = model.prefill([prompt], [slot], alone)[0]
            assert torch.allclose(logits[row], ref, atol=1e-5), row
            for mine, theirs in zip(shared.stores, alone.stores, strict=True):
                for layer in range(cfg.layers):
                    n = len(prompt)
                    assert torch.allclose(
                        mine[layer][slots[row], :, :n], theirs[layer][slot, :, :n], atol=1e-5
                    )


def test_decode_over_scattered_slots_equals_decode_over_consecutive_ones(model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    model = TinyLM(cfg, read_safetensors_dir(model_dir))
    prompts = [[1, 5, 6], [9, 3, 2, 8], [7, 7]]
    with torch.inference_mode():
        together = KVCache(cfg)
        slots = [together.allocate(16) for _ in prompts]
        assert slots == [0, 1, 2]
        first = model.prefill(prompts, slots, together).argmax(-1).tolist()
        step = model.decode(first, [len(p) for p in prompts], slots, together)
        apart = KVCache(cfg)
        taken = [apart.allocate(16) for _ in range(7)]
        scattered = [taken[6], taken[2], taken[4]]  # not consecutive, not in order
        model.prefill(prompts, scattered, apart)
        other = model.decode(first, [len(p) for p in prompts], scattered, apart)
    assert torch.allclose(step, other, atol=1e-5)


def test_unfiltered_rows_sample_without_sorting_and_keep_their_own_seed() -> None:
    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().expand(3, 3)
    plain, nucleus = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)
    # A plain row's token depends on its own seed only, whatever rows share its batch.
    alone = choose_tokens(logits[:1], [plain], [torch.Generator().manual_seed(3)], False).tokens[0]
    gens = [torch.Generator().manual_seed(s) for s in (9, 3, 4)]
    mixed = choose_tokens(logits, [nucleus, plain, nucleus], gens, False)
    assert mixed.tokens[1] == alone
    assert mixed.tokens[0] == mixed.tokens[2] == 1  # top_p 0.5: only the most likely token
    # Inverse CDF in vocabulary order: each token owns its slice of [0, 1).
    cuts = torch.tensor([[0.05], [0.2], [0.69], [0.71]])
    picked = _draw_unfiltered(probs.expand(4, 3), cuts, [0, 1, 2, 3])
    assert picked.tolist() == [0, 1, 1, 2]
    # A draw rounded up to the very top takes the last token with any probability.
    tail = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert _draw_unfiltered(tail, torch.tensor([[1.0]]), [0]).tolist() == [1]
