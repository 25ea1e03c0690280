"""FSDP2 inside a node only: the layout FlexDeMo needs, for programs without Accelerate."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def shard_within_node(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    blocks: Iterable[torch.nn.Module] | None = None,
    replicate_dim: str = "replicate",
    **fully_shard_kwargs,
) -> torch.nn.Module:
    """``fully_shard`` each of ``blocks``, then ``model``, over ``mesh`` without its replicate dimension.

    FSDP then averages gradients inside a node and nothing crosses nodes; give FlexDeMo the
    same ``mesh`` for that. ``blocks`` defaults to the modules whose class is named in the
    model's ``_no_split_modules`` (Hugging Face models' transformer blocks), else none.

    Example::

        mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
        shard_within_node(model, mesh)
        opt = FlexDeMo(model.parameters(), mesh=mesh, elementwise=elementwise_parameters(model))
    """
    names = mesh.mesh_dim_names or ()
    if replicate_dim not in names:
        raise ValueError(f"shard_within_node: replicate_dim={replicate_dim!r} is not a dimension of the mesh {names}.")
    inner = tuple(name for name in names if name != replicate_dim)
    if len(inner) != 1:
        raise ValueError(
            f"shard_within_node: the mesh {names} needs exactly one dimension besides {replicate_dim!r}, for the "
            "processes of a node: mesh_dim_names=('replicate', 'shard') with shape (nodes, processes per node)."
        )
    node_mesh = mesh[inner[0]]
    if blocks is None:
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    for block in blocks:
        fully_shard(block, mesh=node_mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=node_mesh, **fully_shard_kwargs)
    return model
