"""FSDP2 inside a node only: the layout FlexDeMo needs, for programs without Accelerate.

Also :func:`clone_view_outputs`, which the Accelerate plugin applies too: FSDP2 modules that
return no views, so that an in-place op after a module cannot skip its backward all-gather.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


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
    clone_view_outputs(model)
    return model


def clone_view_outputs(model: torch.nn.Module) -> int:
    """Make each FSDP2 module in ``model`` return copies of the view tensors it would return.

    FSDP2 gathers a module's parameters for backward from a hook on each tensor the module
    returns. On a view (``t._base`` set), an in-place op after the module (``out += y``) moves
    the tensor to a new autograd node and the hook is lost: backward then runs on freed
    parameters, or on the gathered ones without reducing their gradients. torch (2.13) warns
    about every such module on every rank. T5's first block returns one: its relative position
    bias, ``permute(...).unsqueeze(0)`` of an embedding lookup, which the later blocks take as
    input. transformers 5.23 and 4.57 only add to it out of place, so T5's gradients were right,
    but nothing keeps a model or an attention kernel from adding in place; a copy of the few
    view outputs removes the hazard and the warning (tests/test_fsdp_views.py compares
    gradients with an unwrapped model). The copy runs before FSDP's own post-forward hook.
    Idempotent; returns how many modules got the hook.
    """
    added = 0
    for module in model.modules():
        if isinstance(module, FSDPModule) and not getattr(module, "_flexdemo_clones_views", False):
            module.register_forward_hook(_clone_views, prepend=True)
            module._flexdemo_clones_views = True
            added += 1
    return added


def _clone_views(module: torch.nn.Module, args: Any, output: Any) -> Any:
    return _copy_views(output) if torch.is_grad_enabled() else output


def _copy_views(obj: Any) -> Any:
    """``obj`` with each grad-requiring view tensor in it (in tuples, lists, dicts) replaced by a copy."""
    if isinstance(obj, torch.Tensor):
        return obj.clone() if obj.requires_grad and obj._base is not None else obj
    if isinstance(obj, tuple):
        items = [_copy_views(item) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_copy_views(item) for item in obj]
    if isinstance(obj, dict):  # ModelOutput too: set in place, which keeps its attributes in step
        for key in list(obj):
            obj[key] = _copy_views(obj[key])
    return obj
