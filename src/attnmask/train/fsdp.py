"""Sharded training (``--fsdp``): FSDP2 over torchrun's processes, and checkpoints any number of them resumes.

``torchrun --nproc-per-node N -m attnmask train ... --fsdp`` shards every parameter, gradient and
optimizer state over the N processes (``torch.distributed.fsdp.fully_shard``): each Transformer
layer is one unit, gathered just before it runs and freed after (a decoder layer's cross-attention
projects the encoder's output inside it), and a root unit (:class:`LossStep`: the model's forward
*and* the prediction-head loss, so the tied ``W_pred`` is used inside the unit that owns it) holds
the rest (embeddings, final norm, ``W_pred``).
Gradients are reduce-scattered, averaged over ranks as DDP does, so the loop's loss scaling is the same.

- ``--precision bf16``: parameters are gathered and used in bfloat16, gradients reduced in float32,
  the optimizer's master weights and state stay float32 (``MixedPrecisionPolicy``), under the same
  autocast as one process.
- LoRA: the base weights are sharded and frozen like the rest; only the adapters get gradients and
  optimizer state, and a checkpoint keeps the adapters alone.
- Checkpoints (:func:`save`): ``checkpoint/step-NNNNNNNN/`` in the run directory holds the model and
  optimizer shards, written by every rank (``torch.distributed.checkpoint``), with no knowledge of
  how many wrote them: a resume on another number of processes reads the slices it needs.
  ``trainer_state.pt`` (rank 0, atomic, written after the shards are complete) names that
  directory and keeps the step, the clock, every rank's data position and random state, and the
  global batch in micro-batches; ``model.safetensors`` (or ``adapters.safetensors``) is the full
  weights gathered on rank 0, for inference. An older step directory is removed only once the new
  ``trainer_state.pt`` points past it.
- Resuming on M processes from a run saved by N (:func:`accumulation`, :func:`data_state`): the
  global batch stays (N x grad_accum micro-batches a step, so each of M processes accumulates
  N x grad_accum / M of them), and the data continue at the same global position of the epoch's
  batch plan (batches are dealt to ranks round-robin, so N ranks at position p consumed N x p of
  them). LM blocks are drawn by per-rank random streams: ranks that existed continue theirs, new
  ranks start their own.
- Evaluation (:meth:`Sharded.gathered`) runs on the full weights, gathered onto every rank into an
  unsharded copy for its duration, so the decoding code sees a plain model.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from attnmask.errors import UserError
from attnmask.model import Transformer
from attnmask.model.lora import ADAPTER_KEYS, lora_modules
from attnmask.model.loss import head_loss
from attnmask.train import checkpoint, distributed
from attnmask.train.rundir import ADAPTERS, TRAINER_STATE, WEIGHTS, RunDir

SHARDED_DIR = "checkpoint"  # in the run directory: one step-NNNNNNNN/ of shards per checkpoint
_ROOT_PREFIX = "model."  # LossStep holds the model as .model: its name in the root's state dicts


class LossStep(nn.Module):
    """The FSDP root: the model's hidden states and the summed cross-entropy of ``W_pred``'s logits
    (chunked, never the ``(B, T, V)`` logits), in one forward."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(
        self,
        inputs: Tensor,  # (B, T) decoder input ids
        src: Tensor | None,  # (B, S) encoder input ids, or None
        labels: Tensor,  # (B, T)
        segments: Tensor | None = None,  # (B, T)
        src_segments: Tensor | None = None,  # (B, S)
        *,
        label_smoothing: float = 0.0,
    ) -> Tensor:
        hidden = self.model(inputs, src, segments=segments, src_segments=src_segments, return_hidden=True).hidden
        return head_loss(hidden, self.model.lm_head, labels, label_smoothing=label_smoothing)  # ()


@dataclass
class Sharded:
    """A model sharded with :func:`shard`: the root unit, and what saving and evaluating need."""

    root: LossStep  # call it for a micro-batch's summed loss; .model is the (sharded) Transformer
    lora: bool  # True: only the adapters train, and checkpoints keep them alone
    tied: frozenset[str]  # state-dict names stored under another name in model.safetensors
    _replica: Transformer  # the model's structure on the meta device (buffers real), for evaluation

    @property
    def model(self) -> Transformer:
        return self.root.model

    @contextlib.contextmanager
    def gathered(self) -> Iterator[Transformer]:
        """The full model on every rank (an unsharded copy, freed on exit). Collective: every rank enters."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.root, options=StateDictOptions(full_state_dict=True))
        replica = self._replica
        missing, unexpected = replica.load_state_dict(_unprefixed(full), strict=False, assign=True)
        if unexpected or set(missing) - self.tied:
            raise RuntimeError(f"gathered weights do not fit the model: missing {missing}, unexpected {unexpected}")
        if self.tied:  # tied names absent from the gathered dict: share them again
            _tie_like(replica, self.model)
        del full
        try:
            yield replica
        finally:
            _to_meta(replica)


def shard(model: Transformer, ctx: distributed.Dist, *, bf16: bool) -> Sharded:
    """Shard ``model`` in place over every rank: one unit per Transformer layer, then the root.

    Build the optimizer afterwards, from ``model.parameters()`` (now sharded ``DTensor``s).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    replica = _meta_copy(model)
    tied = _tied_names(model)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    layers = [*getattr(model, "encoder_layers", []), *model.layers]
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    root = LossStep(model)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    return Sharded(root=root, lora=bool(lora_modules(model)), tied=tied, _replica=replica)


def full_norm(norm: Tensor) -> Tensor:
    """``clip_grad_norm_``'s total over sharded gradients is a replicated ``DTensor``: its plain value."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# --- checkpoints -------------------------------------------------------------------------------


def _model_state(sharded: Sharded, **options) -> dict[str, Tensor]:
    """The root's model state dict (sharded, or ``full_state_dict``): the adapters alone for LoRA."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(sharded.root, options=StateDictOptions(**options))
    if sharded.lora:
        state = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in ADAPTER_KEYS}
    return state


def save(sharded: Sharded, optimizer: torch.optim.Optimizer, run: RunDir, state: dict, ctx: distributed.Dist) -> None:
    """Write a checkpoint (see the module docstring). Collective: every rank calls it.

    ``state``: ``trainer_state.pt``'s content (step, clock, ranks, ...) but the weights and optimizer.

    Raises:
        UserError: the weights file does not read back (a full disk).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    name = f"{SHARDED_DIR}/step-{state['step']:08d}"
    if ctx.is_main:  # left by a save that did not finish (no trainer_state.pt names it)
        shutil.rmtree(run / name, ignore_errors=True)
    distributed.barrier(ctx)
    shards = {"model": _model_state(sharded), "optimizer": get_optimizer_state_dict(sharded.root, optimizer)}
    dcp.save(shards, checkpoint_id=run / name)  # returns once every rank's shards and the metadata are written
    full = _model_state(sharded, full_state_dict=True, cpu_offload=True)  # rank 0 alone receives it
    if ctx.is_main:
        checkpoint.save_torch(run / TRAINER_STATE, {**state, "sharded": name})
        file = _write_weights(run, _unprefixed(full), sharded, state["step"])
        if not run.weights_readable(file):
            raise UserError(f"{run / file}: written but does not read back; the disk may be full")
        for old in (run / SHARDED_DIR).glob("step-*"):
            if old.name != Path(name).name:
                shutil.rmtree(old, ignore_errors=True)
    distributed.barrier(ctx)


def save_weights(sharded: Sharded, run: RunDir, step: int, ctx: distributed.Dist) -> str:
    """Only the full weights file (a damaged one rewritten on resume). Collective; returns its name."""
    full = _model_state(sharded, full_state_dict=True, cpu_offload=True)
    name = _write_weights(run, _unprefixed(full), sharded, step) if ctx.is_main else ""
    distributed.barrier(ctx)
    return name


def _write_weights(run: RunDir, full: dict[str, Tensor], sharded: Sharded, step: int) -> str:
    """``adapters.safetensors`` (LoRA) or ``model.safetensors`` with each tied tensor stored once,
    under the name ``safetensors.torch.save_model`` keeps, so that ``load_run`` reads it alike."""
    from safetensors.torch import save_file

    name = ADAPTERS if sharded.lora else WEIGHTS
    tensors = {k: v.contiguous() for k, v in full.items() if k not in sharded.tied}
    checkpoint.atomic_write(run / name, lambda tmp: save_file(tensors, str(tmp), metadata={"step": str(step)}))
    return name


def load(sharded: Sharded, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read a :func:`save` checkpoint's shards into the model and optimizer, whatever the number of
    processes that wrote them. Collective.

    Raises:
        UserError: ``path`` is missing or not a readable checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not (path / ".metadata").is_file():
        raise UserError(f"{path}: missing or incomplete sharded checkpoint (no .metadata); expected a --fsdp run's")
    shards = {"model": _model_state(sharded), "optimizer": get_optimizer_state_dict(sharded.root, optimizer)}
    try:
        dcp.load(shards, checkpoint_id=path)
    except Exception as err:  # DCP wraps every rank's failure in a CheckpointException
        first = " ".join(str(err).split())[:300]
        raise UserError(f"{path}: cannot read the sharded checkpoint ({first})") from err
    set_model_state_dict(sharded.root, shards["model"], options=StateDictOptions(strict=not sharded.lora))
    set_optimizer_state_dict(sharded.root, optimizer, shards["optimizer"])


# --- another number of processes ----------------------------------------------------------------


def accumulation(micro_batches: int, world_size: int, saved_world_size: int, run: RunDir) -> int:
    """Micro-batches each of ``world_size`` processes accumulates to keep the run's global batch.

    Raises:
        UserError: ``world_size`` does not divide the global batch.
    """
    per_rank, rest = divmod(micro_batches, world_size)
    if rest or not per_rank:
        raise UserError(
            f"{run} was saved by {saved_world_size} processes with a global batch of {micro_batches} micro-batches; "
            f"{world_size} processes cannot share it evenly; resume on a number of processes that divides "
            f"{micro_batches}"
        )
    return per_rank


def data_state(saved: list[dict], rank: int, world_size: int) -> tuple[dict | None, str | None]:
    """This rank's data position from the per-rank positions of a run saved by ``len(saved)`` ranks:
    ``(state or None = keep the fresh one, a note for the log or None)``."""
    if len(saved) == world_size:
        return saved[rank], None
    first = saved[0]
    if "position" in first and "world_size" in first:  # a batch plan dealt round-robin (samplers.py)
        consumed = len(saved) * int(first["position"])  # batches of the epoch's plan, all ranks together
        position, rest = divmod(consumed, world_size)
        note = None
        if rest:
            note = f"data: {consumed} batches of epoch {first['epoch']} do not split over {world_size} ranks; "
            note += f"each continues after {position}, {rest} of them are seen again"
        return {**first, "world_size": world_size, "position": position}, note
    if rank < len(saved):  # per-rank random streams (LM blocks)
        return saved[rank], None
    return None, f"data: rank {rank} starts its own stream of blocks (the run was saved by {len(saved)} processes)"


# --- helpers -----------------------------------------------------------------------------------


def _unprefixed(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k.removeprefix(_ROOT_PREFIX): v for k, v in state.items()}


def _tied_names(model: nn.Module) -> frozenset[str]:
    """Names of state-dict entries that are another entry's tensor (a tied ``W_pred``): all but the
    first in sorted order, as safetensors' ``save_model`` drops them."""
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return frozenset(n for names in groups.values() for n in sorted(names)[1:])


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy whose parameters are on the meta device (no storage); buffers are copied."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}  # fmt: skip
    return copy.deepcopy(model, memo)


def _to_meta(model: nn.Module) -> None:
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.device.type != "meta":
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)


def _tie_like(replica: nn.Module, model: nn.Module) -> None:
    """Make ``replica``'s parameters shared where ``model``'s are (by name)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            owner, _, attr = name.rpartition(".")
            replica.get_submodule(owner)._parameters[attr] = replica.get_parameter(first[id(p)])
        else:
            first[id(p)] = name
