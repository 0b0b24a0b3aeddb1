"""Combined forward-backward passes: expert all-to-alls hidden under another micro-batch's compute.

Megatron-Core's batch-level overlap (--overlap-moe-expert-parallel-comm; DeepSeek-V3's DualPipe rests on the same
idea): in 1F1B's steady state a forward and the backward of an earlier micro-batch run as one pass, layer by layer,
and each one's dispatch and combine all-to-alls run on a communication stream while the other computes. Per layer
pair (forward layer i, backward layer n - 1 - i) the order is Megatron-Core's:

    communication: combine(B)  | dispatch(F)  dispatch(B) | combine(F)
    compute:       attention(F) | experts(B)   experts(F)  | attention(B)

To run a backward piece by piece, a chunk's forward is cut into `Step`s at its all-to-alls (model.py
`TransformerChunk.steps`): per MoE block attention with router and permutation, dispatch, experts, combine, output
(unpermutation, shared expert, residual); a dense block is one step; embedding and output layer with the loss are
steps of the first and last chunks. Each compute step runs on its own autograd graph (its input tensors detached),
so its backward can run alone; an exchange runs outside autograd and its gradient is the reverse exchange. Steps
pass a state (name -> tensor or host value) along; gradients flow back name by name.

Each pass is a generator that yields where the other may take over: after issuing an exchange, or after a compute
step that no exchange follows. `interleave` alternates two of them, the backward first. A pass alone runs its
exchanges as issue-then-wait. A forward frees the rows an exchange sent once it has completed (resized to nothing):
the step output they are stays only for its backward's autograd history. The real step and the trace run this same
code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from trainsim.workloads.moe import exchange_rows
from trainsim.workloads.observe import observer

State = dict[str, object]


@dataclass
class Step:
    """One piece of a chunk's forward: `run(state) -> state` (compute), or an all-to-all of the state's `rows`
    (each a tensor of the same rows: tokens, their probabilities) with `exchange(state)` giving (rows sent to each
    rank, rows received from each), over `group` (exchange)."""

    name: str
    run: Callable[[State], State] | None = None
    exchange: Callable[[State], tuple[list[int], list[int]]] | None = None
    group: object = None
    rows: tuple[str, ...] = ("tokens",)
    keeps_turn: bool = False
    """The pass goes on after this step without yielding (embedding forward, loss backward: Megatron-Core runs
    them before the first layer pair)."""
    in_region: bool = True
    """Runs inside the chunk's FP8 autocast region (the blocks and their exchanges; not embedding and loss)."""


def _start_exchange(state: State, keys: tuple[str, ...], send: list[int], receive: list[int], group):
    """Issue the exchange of state[key] for each key; (the rows they will bring by key, what to wait for: each
    work, and its input kept alive)."""
    brought, pending = {}, []
    for key in keys:
        brought[key], work = exchange_rows(state[key], send, receive, group, async_op=True)
        pending.append((work, state[key]))
    return brought, pending


def _wait(pending, release: bool = False) -> None:
    """Wait for an exchange; with `release`, free the rows it sent: the forward keeps the step output they are
    for its backward, which needs only its autograd history (Megatron-Core frees such outputs too)."""
    for work, sent in pending or ():
        with observer().communication():
            work.wait()
        if release:
            sent.untyped_storage().resize_(0)
            observer().released(sent)


def _leaves(state: State, wanted: set[str]) -> State:
    """The state with each tensor that needs a gradient (or is `wanted`: an exchange's result, made outside
    autograd) detached into a leaf of the step's own graph."""
    return {k: v.detach().requires_grad_() if isinstance(v, torch.Tensor) and (v.requires_grad or k in wanted)
            else v for k, v in state.items()}


@dataclass
class _Done:
    step: Step
    inputs: State
    outputs: State
    sizes: tuple[list[int], list[int]] | None = None


@dataclass
class ChunkPass:
    """One micro-batch through one chunk, step by step, kept for its backward."""

    steps: list[Step]
    region: Callable[[], contextlib.AbstractContextManager] | None = None
    """The chunk's FP8 autocast (fp8.Fp8Region.autocast): entered at the first step inside it, left after the
    last, as the plain forward does around its blocks (leaving it reduces the forward amaxes)."""
    done: list[_Done] = field(default_factory=list)
    output: State | None = None
    input_grads: State | None = None

    def forward(self, state: State) -> Iterator[None]:
        with contextlib.ExitStack() as region:
            yield from self._forward(state, region)

    def _forward(self, state: State, region: contextlib.ExitStack) -> Iterator[None]:
        pending, wanted, inside = None, set(), False
        for i, step in enumerate(self.steps):
            if self.region is not None and step.in_region != inside:
                _wait(pending, release=True)  # (an exchange is inside the region: this is a compute step)
                pending = None
                if step.in_region:
                    region.enter_context(self.region())
                else:
                    region.close()
                inside = step.in_region
            if step.exchange is not None:
                send, receive = step.exchange(state)
                brought, pending = _start_exchange(state, step.rows, send, receive, step.group)
                wanted |= {key for key in step.rows if state[key].requires_grad}
                state = {**state, **brought}
                self.done.append(_Done(step, {}, {}, (send, receive)))  # (keeps no tensor: the sent rows may go)
                yield
                continue
            _wait(pending, release=True)
            pending = None
            inputs = _leaves(state, wanted)
            wanted = set()
            state = step.run(dict(inputs))
            self.done.append(_Done(step, inputs, state))
            following = self.steps[i + 1] if i + 1 < len(self.steps) else None
            if not step.keeps_turn and not (following is not None and following.exchange is not None):
                yield
        _wait(pending, release=True)
        self.output = state

    def backward(self, grads: State) -> Iterator[None]:
        """grads: of the output state's tensors by name (None for a scalar loss: a gradient of one)."""
        pending = None
        while self.done:
            entry = self.done.pop()  # (what a step kept goes once its backward has run, as the activations do)
            if entry.sizes is not None:
                send, receive = entry.sizes  # the gradient goes back the way the rows came
                keys = tuple(key for key in entry.step.rows if key in grads)
                brought, pending = _start_exchange(grads, keys, receive, send, entry.step.group)
                grads.update(brought)
                yield
                continue
            _wait(pending)
            pending = None
            keeps_turn = entry.step.keeps_turn or (self.done and self.done[-1].sizes is not None)
            grads = _step_backward(entry, grads)
            del entry  # (a suspended pass would keep it)
            if not keeps_turn:
                yield
        _wait(pending)
        self.input_grads = grads


def _step_backward(entry: _Done, grads: State) -> State:
    outputs, gradients, through = [], [], {}
    for name, out in entry.outputs.items():
        if not isinstance(out, torch.Tensor) or name not in grads:
            continue
        if out is entry.inputs.get(name):  # passed along unchanged: its gradient too
            through[name] = grads[name]
        elif out.requires_grad:
            outputs.append(out)
            gradients.append(grads[name])
    if outputs:
        torch.autograd.backward(outputs, gradients)
    result: State = {}
    for name, leaf in entry.inputs.items():
        if not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
            continue
        grad = leaf.grad
        if name in through:
            grad = through[name] if grad is None else grad + through[name]
        if grad is not None:
            result[name] = grad
    return result


def run_alone(pass_: Iterator[None]) -> None:
    for _ in pass_:
        pass


def interleave(sides: list[tuple[Callable[[], object], Iterator[None]]]) -> None:
    """Advance each side in turn by one unit, inside its context (the observer's section), until all are done."""
    active = list(sides)
    while active:
        for side in list(active):
            context, pass_ = side
            with context():
                try:
                    next(pass_)
                except StopIteration:
                    active.remove(side)
