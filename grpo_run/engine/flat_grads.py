"""The update's gradients in one buffer, allocated at its first backward and freed after its optimizer step.

Left to autograd, each parameter's gradient is allocated when its layer's backward first reaches it:
some 270 tensors of 0.3-113 MB (SmolLM2) that live until the optimizer step, born in the middle of the
backward's transients. The C allocator hands them out from the same heap, so the freed transients
around them cannot go back to the OS until the step: SmolLM2's reference setting (32 rows of 50 + 128
tokens) peaked 0.4-0.5 GB higher (README, Performance). Here every gradient is a view into one
buffer of all trainable parameters' elements, mapped in one piece, which autograd accumulates into in
place; the values are autograd's own (0 + g = g).

A parameter that no backward of the update reached keeps `grad = None`, as autograd would leave it, so
the optimizer skips it (no weight decay, no moment decay) rather than taking a zero gradient.
"""

import torch


class FlatGrads:
    """Contiguous gradients for `params` (one dtype and device; `usable` says whether they are)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.buffer: torch.Tensor | None = None
        self._reached: set[int] = set()  # ids of the parameters a backward accumulated into
        for p in params:
            p.register_post_accumulate_grad_hook(self._mark)

    @staticmethod
    def usable(params: list[torch.nn.Parameter]) -> bool:
        return bool(params) and len({(p.dtype, p.device) for p in params}) == 1

    def _mark(self, p: torch.nn.Parameter) -> None:
        self._reached.add(id(p))

    def attach(self) -> None:
        """Before a backward: give every parameter its zeroed view, once per update."""
        if self.buffer is not None:
            return
        first = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device)
        offset = 0
        for p in self.params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def drop_unreached(self) -> None:
        """Before the optimizer step: the parameters no backward reached get `grad = None` again."""
        for p in self.params:
            if id(p) not in self._reached:
                p.grad = None

    def release(self) -> None:
        """After the optimizer step (whose zero_grad dropped the views): free the buffer."""
        self.buffer = None
        self._reached.clear()
