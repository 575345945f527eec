"""DiLoCo: many local inner steps, then one outer step on averaged pseudo-gradients.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"
(Algorithm 1), as run at scale by PRIME (zeroband `Diloco`, INTELLECT-1). The model is wrapped
from outside; the averaging is handed in, so this module never touches the network:

    diloco = DiLoCo(model, DiLoCoConfig(inner_steps=H))
    while True:
        for _ in range(H):
            inputs, targets = sample_batch(...)
            stats = diloco.inner_step(inputs, targets)       # AdamW, warmup + schedule, clipping
        deltas = diloco.pseudo_gradients()                   # Δ = θ_outer - θ_inner, fp32
        averaged = <average deltas over the group, weighted by diloco.tokens_since_outer>
        diloco.apply_outer(averaged)                         # Nesterov SGD on θ_outer; θ_inner ← θ_outer

A node with no group this step applies its own pseudo-gradient (`apply_own()`, or
`apply_outer(deltas)`). The node runs the tensor work of these lines in its training thread.

Overlapped (Streaming DiLoCo's overlap, "eager updates"): `begin_overlap(eager)` ends the
inner phase of step t without an outer step: it keeps Δ_t (`round_deltas`, `round_tokens`) for a
round that runs in the background, and the next inner steps (round t+1) start at once, from
θ_outer(t) moved by our own Δ_t through the outer optimizer (eager) or from where round t ended
(delayed). When the group's average lands, `apply_outer(averaged)` writes θ_outer(t+1) exactly as
a blocking node does (the same operations: members of one group agree bit for bit whichever mode
each runs) and moves θ_inner by θ_outer(t+1) - base, keeping the inner steps trained since. Until
then θ_outer, the momentum and `outer_step` are step t's: the state served, hashed and
checkpointed is always a whole one. The cost is two more fp32 copies of the model (Δ_t and base).

Fragments (Streaming DiLoCo; config.fragments = P > 1, swarm/model/fragments.py): outer step s
averages and updates fragment s mod P alone. `pseudo_gradients`, `round_deltas` and
`apply_outer` then speak of that fragment's tensors only (in `names` order within it), its
weight (`round_tokens`) counts the tokens since that fragment was last synced, and θ_inner
moves onto θ_outer for that fragment only: the others keep training. P = 1 is plain DiLoCo.

Agreement: members that hold the same θ_outer and momentum and apply the same averaged tensors
end with bit-identical θ_outer, because the outer update (outer_sgd.py) is single IEEE-754 operations.

Precision: θ_outer and the outer momentum are fp32, on the model's device or (offload_outer)
in CPU memory. On CUDA the inner steps run under bf16 autocast with torch's fused AdamW; the
CPU path runs in fp32 with swarm.model.adamw.AdamW (torch's CPU update bit for bit, without
importing torch._dynamo). The inner AdamW state is local and survives outer steps (as in the paper);
only the outer state (`state_dict`) is shared with peers.

Not thread-safe: call inner_step, pseudo_gradients and apply_outer from one thread at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from swarm.model.adamw import AdamW, inner_adamw
from swarm.model.configs import DiLoCoConfig
from swarm.model.fragments import fragments_of
from swarm.model.loss import autocast_for, lm_loss
from swarm.model.outer_sgd import checked_state, checked_tensors, outer_sgd_step
from swarm.model.schedule import inner_lr
from swarm.model.state_hash import state_sha256, tensors_sha256

__all__ = ["DiLoCo", "DiLoCoConfig", "InnerStats", "NonFiniteLossError", "inner_lr"]

T = TypeVar("T")
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# builds the inner optimizer over the trainable parameters (swarm.join: the caller's own)
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, slots=True)
class PendingRound:
    """Step t's round in flight while round t+1 trains (DiLoCo.begin_overlap)."""

    deltas: list[torch.Tensor]  # Δ_t, fp32 on θ_outer's device (of `fragment`'s tensors)
    tokens: int  # Δ_t's averaging weight
    base: list[torch.Tensor]  # θ_inner when round t+1 began; the landing moves it by θ_outer(t+1) - base
    fragment: int = 0  # the fragment step t syncs (config.fragments > 1)


@dataclass(frozen=True, slots=True)
class InnerStats:
    loss: float  # the batch's mean loss before the step
    grad_norm: float  # global gradient norm before clipping
    lr: float  # the learning rate the step used


class NonFiniteLossError(FloatingPointError):
    """An inner step met a NaN/inf loss or gradient; it was skipped and θ_inner left unchanged."""


class DiLoCo:
    """Wraps `model` (its parameters are θ_inner) with θ_outer, the outer momentum and the inner
    AdamW; see the module docstring for the loop."""

    def __init__(
        self,
        model: nn.Module,
        config: DiLoCoConfig,
        *,
        loss_fn: LossFn = lm_loss,
        inner_optimizer: OptimizerFactory | None = None,
    ) -> None:
        self.model, self.config, self.loss_fn = model, config, loss_fn
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.device = self.params[0].device
        outer_device = torch.device("cpu") if config.offload_outer else self.device
        self.outer_params = [p.detach().to(outer_device, torch.float32, copy=True) for p in self.params]
        # the tensor indices of each fragment (one, all of them, unless config.fragments > 1)
        self.parts = fragments_of([p.numel() for p in self.params], config.fragments)
        self._fragment_tokens = [0] * len(self.parts)  # tokens trained since each fragment was last synced
        self.outer_momentum = [torch.zeros_like(t) for t in self.outer_params]
        self.outer_step = 0  # outer steps applied: the swarm's clock
        self.inner_done = 0  # inner steps since the last outer step
        self.tokens_since_outer = 0  # target tokens trained on since the last outer step: the averaging weight
        # bumped whenever θ_inner is written outside an inner step (an outer step, a loaded state):
        # a node of several ranks then broadcasts it to the others (swarm/ranks/leader.py)
        self.revision = 0
        self.pending: PendingRound | None = None  # step t's round in flight (begin_overlap)
        # inner steps allowed past H in this step: a node that would wait for a round in flight
        # trains on (node/loop.py); reset when the step's inner phase ends
        self.extra_room = 0
        self._at_outer = True  # θ_inner is θ_outer, bit for bit (no inner step since the outer one)
        # a caller's own optimizer sets its own learning rate; ours follows config's schedule
        self.owns_lr = inner_optimizer is None
        if inner_optimizer is None:
            self.inner_optimizer: AdamW | torch.optim.Optimizer = inner_adamw(
                named, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, device=self.device
            )
        else:
            self.inner_optimizer = inner_optimizer(self.params)
            if not isinstance(self.inner_optimizer, torch.optim.Optimizer):
                raise TypeError(f"inner_optimizer(params) must return a torch.optim.Optimizer, got "
                                f"{type(self.inner_optimizer).__name__}")  # fmt: skip

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def global_inner_step(self) -> int:
        return self.working_step * self.config.inner_steps + self.inner_done

    @property
    def working_step(self) -> int:
        """The outer step the inner steps are for: outer_step, or the next while a round is in flight."""
        return self.outer_step + (self.pending is not None)

    @property
    def fragment(self) -> int:
        """The fragment that outer step `outer_step` syncs (0 without fragments)."""
        return self.outer_step % len(self.parts)

    @property
    def round_tokens(self) -> int:
        """The averaging weight of the step being averaged: the pending round's, else the tokens
        its fragment has trained on since it was last synced (tokens_since_outer without fragments)."""
        return self.pending.tokens if self.pending is not None else self._fragment_tokens[self.fragment]

    def round_deltas(self) -> list[torch.Tensor]:
        """Δ of the step being averaged: the pending round's (kept), else pseudo_gradients()."""
        return list(self.pending.deltas) if self.pending is not None else self.pseudo_gradients()

    @property
    def ready_for_outer(self) -> bool:
        """H inner steps are done: a next one (extra_room) is past H, with its own data and the
        step's last learning rate."""
        return self.inner_done >= self.config.inner_steps

    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> InnerStats:
        """One AdamW step on one batch. Raises RuntimeError after H steps (apply_outer first) and
        NonFiniteLossError, with nothing changed, when the loss or gradient is not finite."""
        self._check_room()
        lr = self._set_lr()
        loss, tokens = self.forward_backward(inputs, targets)
        return self.step_after_backward(tokens, loss=loss, lr=lr)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The loss of one batch (on the model's device, under autocast there) and its backward:
        (the detached loss, the batch's target tokens). step_after_backward finishes the step."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with autocast_for(self.device):
            loss = self.loss_fn(self.model, inputs, targets)
        loss.backward()
        return loss.detach(), targets.numel()

    def step_after_backward(self, tokens: int, *, loss: torch.Tensor | float | None = None,
                            lr: float | None = None) -> InnerStats:  # fmt: skip
        """The rest of an inner step whose forward and backward the caller ran (swarm.join's loop):
        clip, check, the optimizer's step, count `tokens` toward the averaging weight. Raises
        like inner_step; on NonFiniteLossError the gradients are dropped and nothing else changes."""
        self._check_room()
        if lr is None:
            lr = self._set_lr()
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        loss_t = torch.as_tensor(math.nan if loss is None else loss, dtype=torch.float32, device=norm.device)
        loss_value, norm_value = torch.stack([loss_t.detach().float().reshape(()), norm.float()]).tolist()  # one sync
        finite_loss = loss is None or math.isfinite(loss_value)
        if not (finite_loss and math.isfinite(norm_value)):
            self.inner_optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"loss {loss_value}, gradient norm {norm_value} at step {self.global_inner_step}")
        self.inner_optimizer.step()
        self.inner_optimizer.zero_grad(set_to_none=True)
        self._at_outer = False
        self.inner_done += 1
        self.tokens_since_outer += tokens
        self._fragment_tokens = [t + tokens for t in self._fragment_tokens]
        return InnerStats(loss_value, norm_value, lr)

    def _check_room(self) -> None:
        if self.inner_done >= self.config.inner_steps + self.extra_room:
            raise RuntimeError(f"{self.inner_done} inner steps done: apply an outer step first")

    def _set_lr(self) -> float:
        """Our schedule's rate for this step, set on our optimizer; a caller's optimizer keeps its
        own (its first group's rate is reported)."""
        groups = self.inner_optimizer.param_groups
        if not self.owns_lr:
            return float(groups[0].get("lr", math.nan))
        past_last = max(0, self.inner_done - (self.config.inner_steps - 1))  # extra steps keep the last one's rate
        lr = inner_lr(self.config, self.global_inner_step - past_last)
        for group in groups:
            group["lr"] = lr
        return lr

    @torch.no_grad()
    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Δ = θ_outer - θ_inner of this step's fragment (the whole model without fragments): new
        fp32 tensors on θ_outer's device, in `self.names` order."""
        if self.pending is not None:
            raise RuntimeError("a round is in flight: θ_inner is not relative to θ_outer (round_deltas)")
        return [self.outer_params[i] - self.params[i].detach().to(self.outer_params[i].device, torch.float32)
                for i in self.parts[self.fragment]]  # fmt: skip

    @torch.no_grad()
    def apply_outer(self, averaged: Sequence[torch.Tensor]) -> None:
        """The outer step with the group's averaged Δ: Nesterov SGD on θ_outer, θ_inner ← θ_outer
        (or, with a round in flight, θ_inner moved by θ_outer(t+1) - base: the module docstring).
        Raises ValueError, with nothing changed, on a wrong count, shape or a non-finite value."""
        fragment = self.fragment  # the step's: a pending round's step is outer_step still
        indices = self.parts[fragment]
        grads = self._checked(averaged, "averaged pseudo-gradient", indices)
        self._outer_update(indices, grads, commit=True)
        pending, self.pending = self.pending, None
        if pending is None:
            self._finish_outer_step(fragment=fragment)
            return
        for i, base in zip(indices, pending.base, strict=True):
            p = self.params[i].detach()
            p.add_((self.outer_params[i] - base).to(p.device, p.dtype))
        self.revision += 1
        self.outer_step += 1  # inner_done and the tokens count round t+1's steps, already under way

    def _outer_update(self, indices: range, grads: Sequence[torch.Tensor], *, commit: bool) -> list[torch.Tensor]:
        """θ_outer's tensors `indices` moved by `grads`: in place with the momentum when `commit`,
        else as new tensors (nothing changed). The same single IEEE-754 operations either way
        (the module docstring)."""
        config = self.config
        if commit:
            return [
                outer_sgd_step(self.outer_params[i], self.outer_momentum[i], g, config)
                for i, g in zip(indices, grads, strict=True)
            ]
        return [outer_sgd_step(self.outer_params[i].clone(), self.outer_momentum[i].clone(), g, config)
                for i, g in zip(indices, grads, strict=True)]  # fmt: skip

    @torch.no_grad()
    def stepped_state(self, averaged: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The state apply_outer(averaged) would make (as state_dict, at outer_step + 1), in new
        tensors: nothing here changes. ValueError as apply_outer. A node one step behind its
        group computes the group's state with it (swarm/state/update.py)."""
        indices = self.parts[self.fragment]
        grads = self._checked(averaged, "averaged pseudo-gradient", indices)
        params, momentum = [t.clone() for t in self.outer_params], [m.clone() for m in self.outer_momentum]
        for i, g in zip(indices, grads, strict=True):
            outer_sgd_step(params[i], momentum[i], g, self.config)
        return {"outer_step": self.outer_step + 1, "params": dict(zip(self.names, params, strict=True)),
                "momentum": dict(zip(self.names, momentum, strict=True))}  # fmt: skip

    def round_shapes(self) -> list[torch.Size]:
        """The shapes of the tensors an outer step averages (its fragment's), in order."""
        return [self.outer_params[i].shape for i in self.parts[self.fragment]]

    @torch.no_grad()
    def begin_overlap(self, *, eager: bool) -> None:
        """End the inner phase of step t with its round still to come (the module docstring):
        Δ_t and its weight are kept, and round t+1's inner steps may begin from θ_outer(t) moved
        by our own Δ_t, the proxy of the group's average (eager), or from where they are
        (delayed). (Eager updates' other proxy, our Δ at our share plus the last average for the
        rest, lost more in scripts/experiments/overlap_sweep.py.)"""
        if self.pending is not None:
            raise RuntimeError("a round is already in flight: land it first (apply_outer)")
        deltas, fragment = self.pseudo_gradients(), self.fragment
        indices = self.parts[fragment]
        if eager:
            base = self._outer_update(indices, deltas, commit=False)
            for i, proxy in zip(indices, base, strict=True):
                self.params[i].detach().copy_(proxy)
            self.revision += 1
        else:
            base = [self.params[i].detach().to(self.outer_params[i].device, torch.float32, copy=True)
                    for i in indices]  # fmt: skip
        self.pending = PendingRound(deltas, self._fragment_tokens[fragment], base, fragment)
        self._at_outer = False
        self.inner_done, self.tokens_since_outer, self.extra_room = 0, 0, 0
        self._fragment_tokens[fragment] = 0  # its next Δ counts from here

    def apply_own(self) -> None:
        """The outer step of a node that found no group: its own pseudo-gradient."""
        self.apply_outer(self.round_deltas())

    @torch.no_grad()
    def on_outer_weights(self, fn: Callable[[], T]) -> T:
        """fn() with θ_outer in the model's parameters (an eval of the swarm's state), θ_inner
        put back after; a plain call when θ_inner is θ_outer (no inner step since the outer one)."""
        if self._at_outer:
            return fn()
        kept = [p.detach().clone() for p in self.params]
        try:
            for p, theta in zip(self.params, self.outer_params, strict=True):
                p.detach().copy_(theta)
            return fn()
        finally:
            for p, k in zip(self.params, kept, strict=True):
                p.detach().copy_(k)

    def state_dict(self) -> dict[str, Any]:
        """The outer state a peer needs: {"outer_step", "params", "momentum"} with fp32 tensors by
        parameter name. The tensors are θ_outer's own (not copies): they change at apply_outer."""
        return {
            "outer_step": self.outer_step,
            "params": dict(zip(self.names, self.outer_params, strict=True)),
            "momentum": dict(zip(self.names, self.outer_momentum, strict=True)),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt an outer state (from a checkpoint or a peer) and start a fresh round from it:
        θ_inner ← θ_outer. Checks names, shapes and finiteness first; on error nothing changes.
        The local inner AdamW state is kept."""
        step, params, momentum = checked_state(state, self.names, self.outer_params)
        for dst, src in zip(self.outer_params + self.outer_momentum, params + momentum, strict=True):
            dst.copy_(src)
        self.outer_step = step
        self._finish_outer_step(advance=False)

    def outer_sha256(self) -> str:
        """sha256 of θ_outer (fp32 bytes in name order): equal on two nodes iff bit-identical."""
        return tensors_sha256(self.outer_params)

    def state_sha256(self) -> str:
        """sha256 of the whole outer state (outer step, θ_outer, outer momentum): two nodes
        hold the same swarm state iff these are equal."""
        return state_sha256(self.state_dict())

    def _finish_outer_step(self, advance: bool = True, fragment: int | None = None) -> None:
        """θ_inner ← θ_outer for `fragment` (the one just synced; None: all, as a loaded state)."""
        self.pending = None  # a loaded state replaces a round in flight and what round t+1 trained
        synced = range(len(self.parts)) if fragment is None else [fragment]
        self._at_outer = len(synced) == len(self.parts)
        for f in synced:
            for i in self.parts[f]:
                self.params[i].detach().copy_(self.outer_params[i])
            self._fragment_tokens[f] = 0
        self.revision += 1
        self.outer_step += int(advance)
        self.inner_done = 0
        self.tokens_since_outer = 0
        self.extra_room = 0

    def _checked(self, tensors: Sequence[torch.Tensor], what: str, indices: range | None = None) -> list[torch.Tensor]:
        """`tensors` as fp32 on θ_outer's device, one for each parameter of `indices` (None: all);
        ValueError on a wrong count, shape or a non-finite value."""
        indices = range(len(self.outer_params)) if indices is None else indices
        return checked_tensors(tensors, what, [self.names[i] for i in indices], [self.outer_params[i] for i in indices])
