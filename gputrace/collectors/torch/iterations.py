"""Where a PyTorch loop's iterations begin and end (iterations tile the loop)."""

from __future__ import annotations

from gputrace.recorder.core import Recorder

# optimizers constructed in this process (torch.optim.Optimizer's __init__: collectors.torch)
_optimizers = [0]


def optimizer_made() -> None:
    _optimizers[0] += 1


class _Iterations:
    """Where the loop's iterations begin and end, from what the hooks see: batch requests,
    outermost forwards (with or without grad), backward passes and optimizer steps.

    A micro-batch is what runs between two boundaries (batch requests; without a loader,
    outermost forwards). An iteration ends with the micro-batch whose optimizer step ran
    (at the next batch request with a loader, so the logging after the step belongs to it;
    at the step's end without one). Until the first optimizer step it is not known whether
    one will come: the boundaries seen so far wait, and become one iteration (accumulation)
    at the first step, or one iteration each (a loop with no optimizer) when the run ends.

    Once an optimizer step ran, a micro-batch that only ran forward passes without grad (or
    with the model in eval mode) is an evaluation batch, not an iteration: an `evaluation`
    span named `batch` (step -1), its step not counted, so steps are the optimizer's; the
    batches in a row are one `evaluation` span named `pass`, from the start of the loader
    that serves them (its workers' start) where it began after the last iteration. A
    training iteration ends where something that is none of it began after its step (a
    DataLoader's start, a checkpoint), not at the next batch request.

    Before the first optimizer step, such a micro-batch is an evaluation batch too where the
    job has built an optimizer (a sanity validation before training, as Lightning runs by
    default; a loop that builds none is inference: an `inference` iteration each). Those
    are held until the first step comes (then written as evaluation) or the run ends
    without one (then an `inference` iteration each: an optimizer built, never stepped)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.loader = False          # the loop asks a DataLoader for batches
        self.seen_step = False       # an optimizer step ran in this process
        self.pending: list[int] = []  # boundaries before the first step
        self.last_bwd = 0
        self.cut = 0                 # the first thing after the step that is not of it
        self.loader_at = 0           # the last DataLoader start (its __iter__)
        self.train_end = 0           # where the last training iteration ended
        self.pass_from = 0           # the evaluation pass in progress: first batch's start
        self.pass_to = 0             # ... its last batch's end
        self.pass_batches = 0
        self.fw_pass = False         # inside a framework's evaluation loop
        # before the first step: the evaluation batches and passes held until it comes
        # (written as evaluation) or the run ends without one (inference iterations)
        self.held: list[tuple[int, int]] = []
        self.held_passes: list[tuple[int, int, int]] = []
        self._reset()
        rec.close_hooks.append(self.finish)

    def _reset(self) -> None:
        self.fwd = self.grad_fwd = self.bwd = self.step = False   # in this micro-batch
        self.step_end = 0
        self.cut = 0

    def _trains(self) -> bool:
        """The job trains: an optimizer stepped, or one is built and no gradients wait for
        its first step."""
        return self.seen_step or (_optimizers[0] > 0 and not self.pending)

    def _boundary(self, t: int) -> None:
        """A micro-batch ends at t; what it ran decides whether an iteration ends too."""
        rec = self.rec
        evaluating = self.fwd and not self.bwd and not self.grad_fwd
        trains = self._trains()
        if not (evaluating and trains and rec._iter_start is not None):
            self.end_pass()
        if rec._iter_start is None:
            rec.open_iteration(t)
        elif self.step:          # (with a loader: without one the step closed it)
            if self.cut and self.cut < t:
                # a loader's start or a checkpoint after the step: no part of the iteration
                rec.close_iteration(self.cut)
                rec.open_iteration(t)
            else:
                rec.close_iteration(t, reopen=True)
            self.train_end = min(self.cut or t, t)
        elif evaluating and trains:
            # forward only, without grad, in a job that trains: an evaluation batch
            start = rec._iter_start
            if not self.pass_batches:
                after = self.loader_at >= self.train_end and self.loader_at <= start
                self.pass_from = self.loader_at if after and self.loader_at else start
            self.pass_to = t
            self.pass_batches += 1
            if self.seen_step:
                rec.close_evaluation(t)
            else:
                self.held.append((start, t))
                rec.drop_iteration()
                rec.open_iteration(t)
        elif evaluating:
            # forward only, without grad, before any optimizer step and without an
            # optimizer: an `inference` iteration (a job that never steps is all of them)
            self._flush_pending()
            rec.close_iteration(t, name="inference", reopen=True)
        elif self.bwd and not self.seen_step:
            self.pending.append(t)
        else:
            return      # accumulating gradients, or nothing ran: the micro-batch goes on
        self._reset()

    def framework_pass(self, begin: bool, t: int) -> int:
        """A framework's own evaluation loop (Lightning's) begins or ends at t: it is the
        pass (its span is the framework collector's), not the batches in a row. At its end
        an evaluation batch still open ends there; before any optimizer step, the batches
        it ran, which no hook saw (the model is found at its first backward), are no part
        of the first iteration. The next batch request opens the next iteration (what runs
        between, a checkpoint, is none of it). Returns its batches."""
        if begin:
            self.end_pass()
            self.aside(t)
            self.fw_pass = True
            return 0
        rec = self.rec
        if self.fwd and not self.bwd and not self.grad_fwd and self._trains() and \
                rec._iter_start is not None:
            self._boundary(t)
            rec.drop_iteration()    # the next batch request opens the next one
        elif not (self.fwd or self.bwd or self.step or self.seen_step) and \
                rec._iter_start is not None:
            rec.drop_iteration()
        n, self.pass_batches, self.fw_pass = self.pass_batches, 0, False
        return n

    def end_pass(self) -> None:
        """The evaluation batches in a row so far are one pass (an `evaluation` span)."""
        if self.fw_pass:
            return      # inside a framework's evaluation loop: that one is the pass
        if self.pass_batches:
            if self.seen_step:
                self.rec.span("evaluation", "pass", self.pass_from, self.pass_to, step=-1,
                              args={"batches": self.pass_batches})
            else:
                self.held_passes.append((self.pass_from, self.pass_to, self.pass_batches))
        self.pass_batches = 0

    def _release(self) -> None:
        """The first optimizer step ran: the batches held before it were evaluation."""
        rec = self.rec
        for a, b in self.held:
            rec.span("evaluation", "batch", a, b, step=-1)
        for a, b, n in self.held_passes:
            rec.span("evaluation", "pass", a, b, step=-1, args={"batches": n})
        self.held, self.held_passes = [], []

    def aside(self, t: int, loader: bool = False) -> None:
        """Something that is no part of a training iteration began at t on the loop's
        thread (a DataLoader's start: `loader`; a checkpoint): an iteration whose step ran
        before it ends there."""
        if loader:
            self.loader_at = t
        if self.step and t >= self.step_end and not self.cut:
            self.cut = t

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

    def exhausted(self, t0: int = 0, t: int = 0) -> None:
        """The loader ran out: an iteration opened by that request (at t0), with nothing in
        it, is none (the next epoch's first request opens the next); an evaluation pass
        ended by it ends when it returned (t: its workers shut down)."""
        if self.pass_batches and self.pass_to == t0 and t:
            self.pass_to = t
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
            self.end_pass()
            self.seen_step = True
            self.pending = []    # the passes before the first step accumulated into it
            self._release()
        self.step = True
        self.step_end = t
        if self.rec._iter_start is None:
            self.rec.open_iteration(t)
        if not self.loader:
            self.rec.close_iteration(t, reopen=True)
            self._reset()

    def finish(self, t: int) -> None:
        rec = self.rec
        self.end_pass()
        if not self.seen_step:
            # no optimizer step came: the held batches were inference, an iteration each
            for a, b in self.held:
                rec.span("iteration", "inference", a, b, step=rec.step)
                rec.step += 1
            self.held, self.held_passes = [], []
        if rec._iter_start is None:
            return
        if self.step and self.loader:
            rec.close_iteration(self.step_end)
        elif self.pending or (self.bwd and not self.seen_step):
            self._flush_pending()
            rec.close_iteration(self.last_bwd or t)
        rec.drop_iteration()   # what follows the last step is no iteration
