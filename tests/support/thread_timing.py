"""Does a backward depend on how CPU threads are scheduled? Helpers for the tests that check it does not."""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def backward_nodes(t: torch.Tensor) -> set[str]:
    """The type names of every node in the autograd graph behind `t` (e.g. IndexBackward0: indexing, whose CPU
    backward is index_put_ with accumulate, summing duplicate indices in thread order)."""
    names, stack, done = set(), [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in done:
            continue
        done.add(node)
        names.add(type(node).__name__)
        stack.extend(f for f, _ in node.next_functions)
    return names


def gradients_beside_a_busy_thread(model: torch.nn.Module, loss: Callable[[], torch.Tensor],
                                   times: int = 6) -> list[torch.Tensor]:
    """`loss().backward()` `times` times at 2 intra-op threads while a thread of this process spins beside them;
    each time the model's gradients as one flat tensor."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    busy = threading.Thread(target=spin, daemon=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    busy.start()
    try:
        grads = []
        for _ in range(times):
            model.zero_grad(set_to_none=True)
            loss().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    finally:
        stop.set()
        busy.join()
        torch.set_num_threads(threads)
    return grads
