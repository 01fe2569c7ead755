"""torch.distributed's private API (torch 2.11.0-2.15.0): the modules FSDP2
(``fully_shard``) manages and the DistributedDataParallel whose forward is
running. Imports nothing from wfpass."""
from __future__ import annotations

import sys

import torch


def fsdp2_modules() -> list:
    """Live modules ``fully_shard`` (FSDP2) manages: the ``FSDPModule``
    instances in torch.distributed's registry of composable-API module states
    (``torch.distributed._composable_state._module_state_mapping``, a private
    WeakKeyDictionary; torch 2.13.0). Read only if torch.distributed's FSDP is
    already imported (no FSDP2 module can exist otherwise); ``[]`` where the
    registry is missing or changed shape."""

    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    mapping = getattr(sys.modules.get("torch.distributed._composable_state"), "_module_state_mapping", None)
    if fsdp_module is None or not mapping:
        return []
    try:
        return [m for m in list(mapping.keys()) if isinstance(m, fsdp_module)]
    except Exception:  # pragma: no cover - the registry changed shape
        return []


def ddp_tensors() -> set:
    """``id``s of the Parameters and buffers of the DistributedDataParallel
    whose forward is running now (Dynamo compiles a DDP model's graphs inside
    it): ``DistributedDataParallel._get_active_ddp_module()``, private, the
    same call Dynamo's DDPOptimizer makes (torch/_dynamo/convert_frame.py;
    torch 2.13.0). Empty outside a DDP forward.

    Why a format must not change their dtype: DDP's reducer hooked each
    Parameter's gradient accumulator when it was built, and autograd replaces
    a Parameter's accumulator when ``param.data`` changes type, so the hook
    would never fire again (DDP then raises "Expected to have finished
    reduction", or with ``find_unused_parameters=True`` silently stops
    all-reducing that gradient); its buffers are broadcast from lists DDP
    also built up front."""
    ddp = active_ddp()
    if ddp is None:
        return set()
    mod = ddp.module
    return {id(t) for t in (*mod.parameters(), *mod.buffers())}


def active_ddp():
    """The DistributedDataParallel whose forward is running now, or None
    (``DistributedDataParallel._get_active_ddp_module()``, private; torch 2.13.0)."""

    ddp_cls = getattr(sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", None)
    get = getattr(ddp_cls, "_get_active_ddp_module", None)
    return get() if get is not None else None


def fsdp2_sharded_of(t: torch.Tensor):
    """The sharded Parameter (a DTensor) that FSDP2 (``fully_shard``)
    all-gathered into ``t``, or None. Dynamo traces the forward between
    FSDP's hooks, where the module holds plain unsharded Parameters; after
    the forward FSDP puts the sharded ones back, and those are what
    ``model.named_parameters()`` shows. Reads each module's
    ``_get_fsdp_state()._fsdp_param_groups[*].fsdp_params[*]`` and their
    ``_unsharded_param`` / ``sharded_param`` (private; torch 2.13.0-2.15.0;
    torch 2.11.0 holds one group, ``_fsdp_param_group``)."""
    for m in fsdp2_modules():
        try:
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch 2.11
                one = getattr(state, "_fsdp_param_group", None)
                groups = [one] if one is not None else []
            for g in groups:
                for fp in g.fsdp_params:
                    if getattr(fp, "_unsharded_param", None) is t:
                        return fp.sharded_param
        except Exception:  # pragma: no cover - FSDP2's internals changed shape
            return None
    return None

