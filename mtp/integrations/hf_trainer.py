"""``transformers.Trainer`` for models split by mtp: :class:`Trainer`.

A plain ``transformers.Trainer`` under torchrun lets ``accelerate`` wrap the model in
``torch.nn.parallel.DistributedDataParallel`` over every rank: its first broadcast overwrites the
tensor-parallel shards of ranks > 0, each tensor-parallel rank gets a different part of the
data, the gradient norm is each rank's shard norm, and the checkpoint holds rank 0's shards
(``parallelize_hf`` refuses such a DDP at the first forward). This subclass changes exactly
those pieces and keeps the rest of the Trainer (schedules, logging, callbacks, evaluation of
the loss):

- **Data parallel over the data-parallel group only**: the model is wrapped in
  :class:`mtp.optim.DistributedDataParallel` (dense gradients averaged over
  ``mtp.parallel``'s data-parallel group, expert gradients over the expert-data-parallel group,
  sequence-parallel gradients summed over the tensor-parallel group), and the training batches
  are split over the data-parallel ranks only (every tensor-parallel rank of a data-parallel
  replica reads the same batch).
- **Loss scaling** with ``num_items_in_batch``: the Trainer's own formulas with the
  tensor-parallel size that this model has (:meth:`Trainer.get_tp_size`).
- **Clipping** with :func:`mtp.optim.clip_grad_norm` (every gradient element counted once in
  the job), and the logged ``grad_norm`` is that global norm.
- **Checkpoints**: the model is saved with ``save_pretrained`` on every rank (the model's
  state dict is the full HF one, gathered on every rank; the main process writes it), so
  ``AutoModelForCausalLM.from_pretrained`` loads it; each rank saves its own
  optimizer state (``optimizer.rank<r>-of-<world>.pt``); resuming reads each rank's slices
  with :func:`~mtp.integrations.hf.load_hf_state_dict` and its optimizer file.

Set up ``mtp.parallel.initialize_model_parallel(...)`` before building the model under
torchrun; a single process needs nothing.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, DistributedSampler

from mtp.optim import DistributedDataParallel
from mtp.optim.clip_grads import _reduce_group, clip_grad_norm, get_grad_norm
from mtp.optim.clip_grads import param_is_not_duplicate

__all__ = ["Trainer"]

_INFO = "_mtp_hf"
_SCHEDULER = "scheduler.pt"


class _TrainerDDP(DistributedDataParallel):
    """:class:`mtp.optim.DistributedDataParallel` as the Trainer drives it: ``zero_grad()``
    also empties the gradient buffers."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_buffer()


class _EpochDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches its :class:`DistributedSampler` (the Trainer
    calls it on the loader)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _native_format() -> dict:
    """``save_pretrained`` keywords that keep the model's own tensor names and layouts:
    transformers 5 otherwise writes MoE experts in the legacy per-expert format
    (``block_sparse_moe.experts.0.w1.weight``), which ``load_hf_state_dict`` (resume) does not
    read; ``from_pretrained`` reads both."""
    import inspect

    params = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters
    return {"save_original_format": False} if "save_original_format" in params else {}


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for models parallelized by mtp (see the module docstring).

    Same arguments as ``transformers.Trainer``. Under torchrun with more than one rank,
    :func:`mtp.parallel.initialize_model_parallel` must have run (its data-parallel group is the
    one the batches and gradients are split over). ``train_sampling_strategy`` must be
    ``"random"`` or ``"sequential"`` there; ``fp16`` (loss scaling) is not supported with more
    than one rank (use ``bf16``).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mtp_ddp: _TrainerDDP | None = None
        if not _distributed():
            return
        from mtp import parallel

        if not parallel.model_parallel_is_initialized():
            raise ValueError(
                "mtp.integrations.hf.Trainer: torch.distributed runs several ranks but "
                "mtp.parallel.initialize_model_parallel(...) was not called; call it before "
                "building the model (its data-parallel group splits the batches)"
            )
        if self.args.fp16:
            raise ValueError(
                "mtp.integrations.hf.Trainer: fp16=True (dynamic loss scaling) is not supported "
                "with several ranks; use bf16=True"
            )
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        if strategy not in ("random", "sequential"):
            raise ValueError(
                f"mtp.integrations.hf.Trainer: train_sampling_strategy={strategy!r} is not "
                "supported with several ranks; use 'random' or 'sequential'"
            )
        self._check_expert_groups(parallel)
        self._dp_group = parallel.get_data_parallel_group(with_context_parallel=True)
        self._dp_rank = dist.get_rank(self._dp_group)
        self._dp_size = dist.get_world_size(self._dp_group)

    def _check_expert_groups(self, parallel) -> None:
        """The experts' gradients are reduced and counted in the norm by ``mtp.parallel``'s
        expert groups: they must be the group the model's experts are split over, with no
        expert tensor parallelism (else the grad norm would skip the experts of some ranks)."""
        info = getattr(self.model, _INFO, None)
        group = None if info is None else info.get("ep_group")
        if group is None or dist.get_world_size(group) == 1:
            return
        ranks = dist.get_process_group_ranks(group)
        theirs = dist.get_process_group_ranks(parallel.get_expert_model_parallel_group())
        if ranks != theirs or parallel.get_expert_tensor_parallel_world_size() != 1:
            raise ValueError(
                f"mtp.integrations.hf.Trainer: the model's experts are split over ranks {ranks} "
                f"but mtp.parallel's expert-parallel group is {theirs} with expert tensor "
                f"parallel size {parallel.get_expert_tensor_parallel_world_size()}; call "
                f"mtp.parallel.initialize_model_parallel(..., expert_model_parallel_size="
                f"{len(ranks)}, expert_tensor_parallel_size=1) before building the model"
            )

    # -- parallel sizes and data -------------------------------------------------------------

    def get_tp_size(self) -> int:
        """The ranks that hold one data-parallel replica (they see the same batch)."""
        if not _distributed():
            return super().get_tp_size()
        return dist.get_world_size() // self._dp_size

    def get_train_dataloader(self) -> DataLoader:
        if not _distributed():
            return super().get_train_dataloader()
        if self.train_dataset is None:
            raise ValueError("mtp.integrations.hf.Trainer: training requires a train_dataset")
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        if is_hf_dataset:
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = DistributedSampler(
            dataset, num_replicas=self._dp_size, rank=self._dp_rank,
            shuffle=strategy == "random", seed=seed, drop_last=self.args.dataloader_drop_last,
        )  # fmt: skip
        return _EpochDataLoader(
            dataset, batch_size=self._train_batch_size, sampler=sampler, collate_fn=collator,
            drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )  # fmt: skip

    # -- data-parallel wrapper, gradient sync and clipping -----------------------------------

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if isinstance(model, _TrainerDDP):
            return model
        if not _distributed():
            return super()._wrap_model(model, training, dataloader)
        if not training:
            return model
        if self._mtp_ddp is None or self._mtp_ddp.module is not model:
            self._mtp_ddp = _TrainerDDP(model, overlap_grad_reduce=True)
        return self._mtp_ddp

    def _finish_grad_sync(self, model) -> None:
        if isinstance(model, _TrainerDDP):
            model.finish_grad_sync()

    def _clip_grad_norm(self, model):
        self._finish_grad_sync(model)
        return clip_grad_norm(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        self._finish_grad_sync(model)
        if grad_norm is None:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = get_grad_norm([p.grad for p in params],
                                      [param_is_not_duplicate(p) for p in params],
                                      2.0, _reduce_group())  # fmt: skip
        return grad_norm

    # -- checkpoints --------------------------------------------------------------------------

    def _split_by_mtp(self) -> bool:
        return hasattr(self.model, _INFO)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the full model in HF names and layouts (loadable by ``from_pretrained``):
        ``save_pretrained`` on every rank (the model's state dict gathers the shards), written
        by the main process. Collective for a model split by mtp: call it on every rank."""
        if not self._split_by_mtp():
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.model.save_pretrained(output_dir, is_main_process=self.args.should_save,
                                   **_native_format())  # fmt: skip
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if _distributed():
            dist.barrier()

    def _optimizer_file(self, folder: str) -> str:
        return os.path.join(
            folder, f"optimizer.rank{dist.get_rank()}-of-{dist.get_world_size()}.pt"
        )

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not _distributed():
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        torch.save(self.optimizer.state_dict(), self._optimizer_file(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not _distributed():
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = self._optimizer_file(checkpoint)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"mtp.integrations.hf.Trainer: no optimizer state {path} for this rank (was the "
                "checkpoint written with the same number of ranks?)"
            )
        self.optimizer.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True)
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._split_by_mtp():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from .hf_state import load_hf_state_dict

        load_hf_state_dict(self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        if not self._split_by_mtp():
            return super()._load_best_model()
        from .hf_state import load_hf_state_dict

        load_hf_state_dict(self.model, self.state.best_model_checkpoint)
