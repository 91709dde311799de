"""A group's generate requests travel as one batched call: what the batcher sends, and what each
caller gets back when the batch succeeds, fails or is abandoned (no engine: the send is a stub)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import pytest

from tether.rollout.engine_api.generate_batch import GenerateBatcher, Pending


class Recorder:
    """A stand-in for the HTTP call: records each batch, answers each prompt with its rid."""

    def __init__(self, fail: Exception | None = None, hold: asyncio.Event | None = None) -> None:
        self.batches: list[tuple[Hashable, list[str]]] = []
        self.fail = fail
        self.hold = hold
        self.cancelled = 0
        self.arrived = asyncio.Event()  # set at each batch sent; the test clears it
        self.ended = asyncio.Event()  # set when a batch's send ends

    async def send(self, key: Hashable, batch: list[Pending]) -> list[str]:
        self.batches.append((key, [r.rid for r in batch]))
        self.arrived.set()
        try:
            return await self._answer(batch)
        finally:
            self.ended.set()

    async def _answer(self, batch: list[Pending]) -> list[str]:
        try:
            if self.hold is not None:
                await self.hold.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail is not None:
            raise self.fail
        return [f"answer:{r.rid}" for r in batch]


def request(rid: str) -> Pending:
    return Pending([1, 2, 3], {"max_new_tokens": 4}, rid)


def test_requests_of_one_iteration_under_one_key_go_as_one_batch() -> None:
    async def main() -> tuple[list[str], Recorder]:
        sent = Recorder()
        batcher: GenerateBatcher[str, str] = GenerateBatcher(sent.send)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(batcher.submit("g1", request(f"a{i}"))) for i in range(4)]
            tasks += [tg.create_task(batcher.submit("g2", request(f"b{i}"))) for i in range(2)]
        later = await batcher.submit("g1", request("late"))  # a later iteration: a batch of its own
        return [t.result() for t in tasks] + [later], sent

    answers, sent = asyncio.run(main())
    assert answers == [f"answer:a{i}" for i in range(4)] + ["answer:b0", "answer:b1", "answer:late"]
    assert sent.batches == [("g1", ["a0", "a1", "a2", "a3"]), ("g2", ["b0", "b1"]), ("g1", ["late"])]


def test_a_failed_batch_fails_each_caller_with_its_error() -> None:
    async def main() -> list[BaseException | str]:
        sent = Recorder(fail=RuntimeError("engine said no"))
        batcher: GenerateBatcher[str, str] = GenerateBatcher(sent.send)
        return await asyncio.gather(
            *(batcher.submit("g", request(f"r{i}")) for i in range(3)), return_exceptions=True
        )

    results = asyncio.run(main())
    assert [str(r) for r in results] == ["engine said no"] * 3
    assert all(isinstance(r, RuntimeError) for r in results)


def test_the_batch_is_cancelled_only_once_every_caller_has_gone() -> None:
    async def main() -> tuple[Recorder, list[str], bool]:
        hold = asyncio.Event()
        sent = Recorder(hold=hold)
        batcher: GenerateBatcher[str, str] = GenerateBatcher(sent.send)
        first = asyncio.create_task(batcher.submit("g", request("x")))
        second = asyncio.create_task(batcher.submit("g", request("y")))
        await sent.arrived.wait()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        still_sending = sent.cancelled == 0 and not sent.ended.is_set()
        hold.set()
        kept = [await second]
        # Both callers of the next batch go away: its request is cancelled.
        hold.clear()
        sent.arrived.clear()
        sent.ended.clear()
        third = asyncio.create_task(batcher.submit("g", request("z")))
        fourth = asyncio.create_task(batcher.submit("g", request("w")))
        await sent.arrived.wait()
        third.cancel()
        fourth.cancel()
        await asyncio.gather(third, fourth, return_exceptions=True)
        await sent.ended.wait()
        return sent, kept, still_sending

    sent, kept, still_sending = asyncio.run(main())
    assert still_sending and kept == ["answer:y"]
    assert sent.batches[1] == ("g", ["z", "w"]) and sent.cancelled == 1


def test_close_cancels_batches_in_flight_and_their_callers() -> None:
    async def main() -> tuple[Recorder, bool]:
        sent = Recorder(hold=asyncio.Event())
        batcher: GenerateBatcher[str, str] = GenerateBatcher(sent.send)
        waiter = asyncio.create_task(batcher.submit("g", request("x")))
        await sent.arrived.wait()
        await batcher.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return sent, waiter.cancelled()

    sent, cancelled = asyncio.run(main())
    assert sent.cancelled == 1 and cancelled


def test_the_router_passes_batch_keys_on_except_in_front_of_the_sglang_router() -> None:
    from tether.rollout.engine_api.client import EngineClient, GenerateResponse
    from tether.rollout.routing.router import Router

    class Client(EngineClient):
        def __init__(self) -> None:
            super().__init__("http://127.0.0.1:9", name="e0")
            self.keys: list[Hashable | None] = []

        async def generate(
            self, *args: object, batch_key: Hashable | None = None, **kwargs: object
        ) -> GenerateResponse:
            self.keys.append(batch_key)
            return GenerateResponse()

    async def main(batching: bool) -> list[Hashable | None]:
        client = Client()
        router = Router([client], batch_requests=batching)
        await router.generate([1, 2], {}, batch_key="group-7")
        return client.keys

    assert asyncio.run(main(True)) == ["group-7"]
    assert asyncio.run(main(False)) == [None]
