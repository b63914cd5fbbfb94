"""A Hugging Face ``Trainer`` run on an mtp tensor-parallel model (torchrun, gloo on CPU).

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_tp.py --tp 2
    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_tp.py --tp 2   # tp=2 x dp=2
    python examples/hf_trainer_tp.py --reference   # the same run: one process, plain HF
    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_tp.py --tp 2 --moe --ep 4
    python examples/hf_trainer_tp.py --reference --moe

``--moe``: a tiny Mixtral instead (4 experts, top-2); ``--ep N`` splits its experts over N ranks
(tp, or a multiple of tp: the experts then span the data-parallel replicas too).

A tiny random Llama is split with ``mtp.integrations.hf.apply_kernels(model, tp=...)`` (mtp's
tensor-parallel layers, SwiGLU and vocab-parallel fused linear cross-entropy) and trained by
``mtp.integrations.hf.Trainer``: batches split over the data-parallel ranks only, mtp's
gradient clipping, checkpoints that ``from_pretrained`` loads. Rank 0 prints one JSON line per
optimizer step (loss, grad norm, a fingerprint of the full weights) and, with ``--resume-check``,
whether a run resumed from the step-``--steps // 2`` checkpoint ends with the same weights.
``--plain-trainer`` uses ``transformers.Trainer`` on the split model instead, which mtp refuses.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def _model(seed: int = 0, moe: bool = False):
    import transformers

    common = dict(
        vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=48, max_position_embeddings=64,
        attn_implementation="eager",
    )
    if moe:
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                            experts_implementation="eager", **common)
    else:
        config = transformers.LlamaConfig(**common)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _dataset(n: int = 24, seq: int = 8):
    g = torch.Generator().manual_seed(11)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 96, (seq,), generator=g)
        labels = ids.clone()
        labels[seq - 1 - i % 3:] = -100  # a few ignored targets, different per row
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _fingerprint(model) -> list[float]:
    """Norm of every full weight (float64), in name order: equal weights give equal lists."""
    from mtp.integrations.hf import hf_state_dict

    state = hf_state_dict(model) if hasattr(model, "_mtp_hf") else model.state_dict()
    return [float(state[k].double().norm()) for k in sorted(state)]


def _args(out: str, per_device: int, steps: int, save_steps: int):
    import transformers

    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, max_steps=steps,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, save_steps=save_steps,
        save_strategy="steps", report_to=[], train_sampling_strategy="sequential",
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_drop_last=True,
    )  # fmt: skip


def _train(trainer_cls, model, args, resume=None):
    import transformers

    records = []

    class Record(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, model=None, **kw):
            records.append({"step": state.global_step, "weights": _fingerprint(trainer.model)})

    trainer = trainer_cls(model=model, args=args, train_dataset=_dataset(),
                          data_collator=_collate, callbacks=[Record()])  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for r in records:
        if r["step"] in logs:
            r["loss"], r["grad_norm"] = logs[r["step"]]["loss"], logs[r["step"]]["grad_norm"]
    return trainer, records


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--out", default="hf_trainer_out")
    p.add_argument("--reference", action="store_true", help="one process, plain HF model/Trainer")
    p.add_argument("--plain-trainer", action="store_true")
    p.add_argument("--resume-check", action="store_true")
    p.add_argument("--moe", action="store_true", help="a tiny Mixtral (4 experts, top-2)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (--moe)")
    a = p.parse_args()

    import transformers

    from mtp.integrations.hf import Trainer, apply_kernels

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.reference:
        trainer, records = _train(transformers.Trainer, _model(moe=a.moe),
                                  _args(a.out, a.global_batch, a.steps, a.steps // 2))
    else:
        import torch.distributed as dist

        from mtp.parallel import initialize_model_parallel

        dist.init_process_group("gloo")
        ep = a.ep or (a.tp if a.moe else 1)
        initialize_model_parallel(tensor_model_parallel_size=a.tp,
                                  expert_model_parallel_size=ep,
                                  expert_tensor_parallel_size=1)  # fmt: skip
        dp = world // a.tp
        args = _args(a.out, a.global_batch // dp, a.steps, a.steps // 2)
        cls = transformers.Trainer if a.plain_trainer else Trainer

        def split(seed: int = 0):
            return apply_kernels(_model(seed, a.moe), tp=a.tp, ep=ep)

        trainer, records = _train(cls, split(), args)
        if a.resume_check:
            checkpoint = os.path.join(a.out, f"checkpoint-{a.steps // 2}")
            resumed, _ = _train(Trainer, split(seed=5), args, resume=checkpoint)
            same = _fingerprint(resumed.model) == _fingerprint(trainer.model)
            if dist.get_rank() == 0:
                print(json.dumps({"resumed_equal": same}), flush=True)
    trainer.save_model(os.path.join(a.out, "final"))
    if int(os.environ.get("RANK", "0")) == 0:
        for r in records:
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
