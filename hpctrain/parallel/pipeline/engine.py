"""Run one rank's schedule: forwards and backwards of its chunks over micro-batches."""

from __future__ import annotations

import functools
import time

import torch

from hpctrain.data.structure import leaves
from hpctrain.models.layers import run_layer, split_input
from hpctrain.models.recompute import checkpoint_without_stat_updates
from hpctrain.parallel.pipeline import p2p_plan
from hpctrain.parallel.pipeline.p2p import StageLinks
from hpctrain.parallel.pipeline.schedule import Action
from hpctrain.runtime.abort import set_context
from hpctrain.runtime.timeline import TIMELINE

__all__ = ["Engine"]


class Engine:
    """Executes Actions for the chunks of one rank.

    ``chunks[c]`` is the list of PipeLayers of local chunk c; their modules live under
    ``root``. ``trace`` (when a list) receives (op, mb, chunk, start, end) of every compute,
    which the bench turns into measured bubble fractions. ``inputs``: the keys of a dict
    input (LayerStack.inputs): the first flows through the layers, the others are side
    inputs each stage reads from its own copy of the micro-batch.
    """

    def __init__(self, root, chunks, links: StageLinks, rank: int, p: int,
                 activation_checkpointing: bool = False, inputs: tuple = ()):
        self.root = root
        self.inputs = inputs
        self._shapes = None  # the input shapes the links' agreed shapes belong to
        self.chunks = chunks
        self.links = links
        self.rank, self.p = rank, p
        self.v = len(chunks)
        self.S = p * self.v
        self.recompute = activation_checkpointing
        self.trace: list | None = None
        self.peak_live = 0
        # Called with (action index, action) before and after each forward/backward: the dp
        # flavour gathers a sharded unit's parameters, frees them, reduces its gradients.
        self.before_action = None
        self.after_action = None
        self._plan = None

    def _forward_chunk(self, c: int, x, side: dict):
        for layer in self.chunks[c]:
            if self.recompute:
                # The recompute runs only this layer: freezing the stage's BatchNorm
                # statistics freezes this layer's.
                fn = functools.partial(run_layer, layer)
                x = checkpoint_without_stat_updates(self.root, fn, self.root, x, side)
            else:
                x = run_layer(layer, self.root, x, side)
        return x

    def _agree_shapes(self, micro: list) -> None:
        """Forget the links' agreed shapes when this run's inputs have other shapes than the
        last run's (batches padded to their longest sample): the stages, which all read the
        same micro-batches, then agree the new shapes by a header again. Fixed shapes cost
        nothing more."""
        shapes = [tuple(tuple(t.shape) for t in leaves(x)) for x, _, _ in micro]
        if shapes != self._shapes:
            self._shapes = shapes
            self.links.meta.clear()

    def _steps(self, actions: list[Action]):
        """The p2p plan of ``actions`` (computed once per schedule)."""
        if self._plan is None or self._plan[0] is not actions:
            self._plan = (actions, p2p_plan.plan(actions, self.rank, self.p, self.v,
                                                 self.links.ordered))
        return self._plan[1]

    def run(self, actions: list[Action], micro: list, loss_fn, precision) -> float:
        """Run ``actions`` over ``micro`` = [(x, y, weight)]; return the weighted loss sum
        (nonzero on the rank of the last stage only)."""
        live: dict = {}   # (mb, chunk) -> (input, output or scaled loss)
        inbox: dict = {}  # Msg -> received tensor, until its action runs
        outbox: dict = {} # Msg -> tensor to send, until its group is posted
        losses = []       # (loss, weight) of each micro-batch, read once at the end
        self._agree_shapes(micro)
        for i, st in enumerate(self._steps(actions)):
            a, g = st.action, st.stage
            if st.pre_sends or st.pre_recvs:
                inbox.update(self.links.post([(m, outbox.pop(m)) for m in st.pre_sends],
                                             st.pre_recvs))
            set_context(phase="forward" if a.op == "F" else "backward")  # flight, timeline
            if self.before_action is not None:
                self.before_action(i, a)
            if a.op == "F":
                x, y, w = micro[a.mb]
                x, side = split_input(self.inputs, x)
                inp = x if st.recv is None else inbox.pop(st.recv)
                if g > 0 and inp.is_floating_point():
                    inp.requires_grad_(True)
                t0 = time.perf_counter()
                with precision.autocast():
                    out = self._forward_chunk(a.chunk, inp, side)
                    if g == self.S - 1:
                        loss = loss_fn(out, y)
                if g == self.S - 1:
                    # float() here would stall the host on a GPU every micro-batch
                    losses.append((loss.detach(), w))
                    out = precision.scale(loss * w)
                else:
                    outbox[st.send] = out.detach()
                live[(a.mb, a.chunk)] = (inp, out)
                self.peak_live = max(self.peak_live, len(live))
            else:
                inp, out = live.pop((a.mb, a.chunk))
                grad = None if st.recv is None else inbox.pop(st.recv)
                t0 = time.perf_counter()
                if out.requires_grad:
                    torch.autograd.backward(out, grad)
                if st.send is not None:  # the previous stage's backward waits for it
                    outbox[st.send] = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            t1 = time.perf_counter()
            if st.post_sends:
                self.links.post([(m, outbox.pop(m)) for m in st.post_sends])
            if self.after_action is not None:  # after the sends: another stage waits on them
                self.after_action(i, a)
            if self.trace is not None:
                self.trace.append((a.op, a.mb, a.chunk, t0, t1))
            if TIMELINE.enabled:
                TIMELINE.span(f"{a.op} mb{a.mb}", "pipeline", TIMELINE.wall(t0),
                              TIMELINE.wall(t1), stage=g, chunk=a.chunk, micro_batch=a.mb)
        if live or inbox or outbox:
            raise RuntimeError(f"pipeline schedule left activations of {sorted(live)} without "
                               f"a backward, or messages {sorted(map(str, [*inbox, *outbox]))} "
                               "unused; the schedule is incomplete")
        self.links.wait_all()
        return self._loss_sum(losses)

    def forward(self, actions: list[Action], micro: list, loss_fn, precision) -> float:
        """Run the forward-only ``actions`` (schedule.forward_only) over ``micro`` = [(x, y,
        weight)] under no_grad: evaluation. Returns the weighted loss sum (nonzero on the rank
        of the last stage only). The dp flavour's action hooks are not called: the caller
        gathers what the chunks need first."""
        inbox: dict = {}
        outbox: dict = {}
        losses = []
        self._agree_shapes(micro)
        with torch.no_grad():
            for st in self._steps(actions):
                a, g = st.action, st.stage
                if st.pre_sends or st.pre_recvs:
                    inbox.update(self.links.post([(m, outbox.pop(m)) for m in st.pre_sends],
                                                 st.pre_recvs))
                x, y, w = micro[a.mb]
                x, side = split_input(self.inputs, x)
                inp = x if st.recv is None else inbox.pop(st.recv)
                with precision.autocast():
                    out = inp
                    for layer in self.chunks[a.chunk]:  # no recompute: nothing is kept
                        out = run_layer(layer, self.root, out, side)
                    if g == self.S - 1:
                        losses.append((loss_fn(out, y).detach(), w))
                    else:
                        outbox[st.send] = out
                if st.post_sends:
                    self.links.post([(m, outbox.pop(m)) for m in st.post_sends])
        if inbox or outbox:
            raise RuntimeError(f"pipeline forward-only run left messages "
                               f"{sorted(map(str, [*inbox, *outbox]))} unused")
        self.links.wait_all()
        return self._loss_sum(losses)

    @staticmethod
    def _loss_sum(losses) -> float:
        loss_sum = 0.0
        for loss, w in losses:  # a running sum, in the order the micro-batches ran
            loss_sum += float(loss) * w
        return loss_sum
