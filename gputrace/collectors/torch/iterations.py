"""Where a PyTorch loop's iterations begin and end (iterations tile the loop)."""

from __future__ import annotations

from gputrace.recorder import Recorder


class _Iterations:
    """Where the loop's iterations begin and end, from what the hooks see: batch requests,
    outermost forwards (with or without grad), backward passes and optimizer steps.

    A micro-batch is what runs between two boundaries (batch requests; without a loader,
    outermost forwards). An iteration ends with the micro-batch whose optimizer step ran
    (at the next batch request with a loader, so the logging after the step belongs to it;
    at the step's end without one). Until the first optimizer step it is not known whether
    one will come: the boundaries seen so far wait, and become one iteration (accumulation)
    at the first step, or one iteration each (a loop with no optimizer) when the run ends."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.loader = False          # the loop asks a DataLoader for batches
        self.seen_step = False       # an optimizer step ran in this process
        self.pending: list[int] = []  # boundaries before the first step
        self.last_bwd = 0
        self._reset()
        rec.close_hooks.append(self.finish)

    def _reset(self) -> None:
        self.fwd = self.grad_fwd = self.bwd = self.step = False   # in this micro-batch
        self.step_end = 0

    def _boundary(self, t: int) -> None:
        """A micro-batch ends at t; what it ran decides whether an iteration ends too."""
        rec = self.rec
        if rec._iter_start is None:
            rec.open_iteration(t)
        elif self.step:          # (with a loader: without one the step closed it)
            rec.close_iteration(t, reopen=True)
        elif self.fwd and not self.bwd and not self.grad_fwd:
            # forward only, without grad: an evaluation batch, not a training iteration
            self._flush_pending()
            rec.close_iteration(t, name="inference", reopen=True)
        elif self.bwd and not self.seen_step:
            self.pending.append(t)
        else:
            return      # accumulating gradients, or nothing ran: the micro-batch goes on
        self._reset()

    def _flush_pending(self) -> None:
        """No optimizer step came: every waiting boundary ends an iteration of its own."""
        rec = self.rec
        for b in self.pending:
            if rec._iter_start is not None and b > rec._iter_start:
                rec.close_iteration(b, reopen=True)
        self.pending = []

    def batch(self, t: int) -> None:
        self.loader = True
        self._boundary(t)

    def exhausted(self) -> None:
        """The loader ran out: an iteration opened by that request, with nothing in it,
        is none (the next epoch's first request opens the next)."""
        if self.rec._iter_start is not None and not self.rec._iter_live:
            self.rec.drop_iteration()

    def forward(self, t: int, grad: bool) -> None:
        if self.rec._iter_start is None:
            self.rec.open_iteration(t)
        elif not self.loader and self.bwd and not self.seen_step:
            # without a loader (and no optimizer yet) a forward after a backward begins a
            # micro-batch: a boundary that the first step, or the run's end, settles
            self._boundary(t)
        self.fwd = True
        self.grad_fwd = self.grad_fwd or grad

    def backward(self) -> None:
        self.bwd = True

    def stepped(self, t: int) -> None:
        if not self.seen_step:
            self.seen_step = True
            self.pending = []    # the passes before the first step accumulated into it
        self.step = True
        self.step_end = t
        if self.rec._iter_start is None:
            self.rec.open_iteration(t)
        if not self.loader:
            self.rec.close_iteration(t, reopen=True)
            self._reset()

    def finish(self, t: int) -> None:
        rec = self.rec
        if rec._iter_start is None:
            return
        if self.step and self.loader:
            rec.close_iteration(self.step_end)
        elif self.pending or (self.bwd and not self.seen_step):
            self._flush_pending()
            rec.close_iteration(self.last_bwd or t)
        rec.drop_iteration()   # what follows the last step is no iteration
