"""Print this rank's parallel groups; runs on CPU with gloo.

    torchrun --nproc-per-node 8 examples/parallel_groups.py --tp 2 --pp 2 --ep 2 --etp 1

Each rank joins the default process group, builds every Megatron-style group with
``mtp.parallel.initialize_model_parallel`` and checks its tensor parallel group with an
all-reduce, then prints one line.
"""

import argparse
import datetime
import sys

import torch
import torch.distributed as dist

import mtp.parallel as mp


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("tp", "pp", "cp", "ep"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    args = p.parse_args()
    # short timeouts: a rank whose peer never joins a collective fails in a minute, not 30
    timeout = datetime.timedelta(minutes=1)
    dist.init_process_group("gloo", timeout=timeout)
    mp.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
        timeout=timeout,
    )
    one = torch.ones(1)
    dist.all_reduce(one, group=mp.get_tensor_model_parallel_group())
    assert one.item() == mp.get_tensor_model_parallel_world_size()
    kinds = ("tp", "pp", "dp", "cp", "ep", "etp", "edp")
    groups = " ".join(f"{k}={mp.get_process_group_ranks(k)}" for k in kinds)
    # one write call per line: ranks share stdout, and a separate newline write could interleave
    sys.stdout.write(f"rank {dist.get_rank():>3}: {groups}\n")
    sys.stdout.flush()
    mp.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
