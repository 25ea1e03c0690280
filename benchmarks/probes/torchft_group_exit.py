"""Which process group prints torch's "destroy_process_group() was not called" at a node's exit.

torchft's group alone (configure, one all-reduce, ``shutdown()``), with markers around its
shutdown, then, as ``kept`` or ``destroyed``, a default group made after it. On CUDA (NCCL) the
warning falls between the shutdown markers: torchft 0.2.0's ``shutdown()`` drops its group
without finalizing it. One process, one GPU or the CPU (gloo prints nothing).

    python benchmarks/probes/torchft_group_exit.py [none|kept|destroyed]
"""

from __future__ import annotations

import argparse
import gc
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("default_group", nargs="?", choices=("none", "kept", "destroyed"), default="none")
    default_group = parser.parse_args().default_group
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = (ProcessGroupNCCL if cuda else ProcessGroupGloo)(timeout=timedelta(seconds=30))
    group.configure(f"127.0.0.1:{store.port}/probe", "probe", 0, 1)
    ones = torch.ones(4, device="cuda" if cuda else "cpu")
    group.allreduce([ones], dist.AllreduceOptions()).wait()
    print(f"torchft group ({'NCCL' if cuda else 'gloo'}): all-reduce gave {ones.sum().item()}", flush=True)
    print("--- torchft group shutdown() begins", flush=True)
    group.shutdown()
    gc.collect()
    print("--- torchft group shutdown() ended", flush=True)
    if default_group != "none":
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.TCPStore("127.0.0.1", 0, is_master=True), rank=0, world_size=1)
        dist.barrier()
        print("--- default group made", flush=True)
        if default_group == "destroyed":
            dist.destroy_process_group()
            print("--- default group destroyed", flush=True)
    print("--- exit", flush=True)


if __name__ == "__main__":
    main()
