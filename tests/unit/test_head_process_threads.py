"""The head's torch runs its step work with one intra-op thread, whoever imported torch."""

from __future__ import annotations

import threading

import torch

from tether.run.process_threads import one_torch_thread_if_imported


def test_torch_imported_gets_one_thread_on_the_calling_thread() -> None:
    seen: list[int] = []

    def on_a_thread() -> None:  # OpenMP keeps the count per thread: a fresh one starts at the default
        torch.set_num_threads(2)
        one_torch_thread_if_imported()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=on_a_thread)
    thread.start()
    thread.join()
    assert seen == [1]
