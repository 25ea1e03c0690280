"""One node of a two-node torchft job that ends with an exchange still pending (tests/test_fault_tolerance_settings.py).

After one exchange both finish, node 0 posts its part of a second all-reduce, with a
completion callback on it, and exits; node 1 posts its part ``--late_s`` seconds later, while node 0 is exiting.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_flexdemo.config import FlexDeMoConfig
from hf_flexdemo.fault_tolerance import node_replicas

parser = argparse.ArgumentParser()
parser.add_argument("--late_s", type=float, default=2.0)
args = parser.parse_args()

replicas = node_replicas(FlexDeMoConfig(fault_tolerance="torchft", min_replicas=2, ft_timeout=30))
replicas.begin()
# One exchange both nodes finish: node 1 has taken node 0's start-up state before node 0 exits.
replicas.group.all_reduce_sum(torch.ones(4)).wait()
values = torch.ones(4)
if replicas.identity.replica_group == 0:
    work = replicas.group.all_reduce_sum(values)
    work._work.get_future().then(lambda done: done.value())
    print("node0 exits with its exchange pending", flush=True)
else:
    time.sleep(args.late_s)
    replicas.group.all_reduce_sum(values).wait()
    print(f"node1 summed {values.tolist()}", flush=True)
