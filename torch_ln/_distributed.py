"""DTensor sharding strategies for every torch_ln operator, read off torch_ln._transforms.OPS.

Accepted placements, per mesh dimension (DTensor redistributes any other input to the cheapest of them):
- every row argument (input, grad_out, mean, rstd; the fused ops' residual, residual_out, grad_residual_out)
  sharded alike on one batch dimension, weight and bias replicated: the outputs' rows are sharded the same way,
  and the backward's weight and bias gradients are Partial(sum) (each rank summed its own rows), which DTensor
  reduces when they are used;
- everything replicated.
A row argument sharded on a normalized dimension is redistributed (DTensor picks the move, e.g. an all-to-all
to a batch-dim shard or an all-gather), not reduced across shards: the kernels need whole rows for their
one-read statistics and their fixed reduction order (bitwise determinism, batch invariance), and a norm's
input is sharded on its hidden dimension only between a ColwiseParallel and a RowwiseParallel linear, which
hand over replicated or sequence-sharded activations.

These use DTensor's op-strategy API (torch.distributed.tensor._ops.utils.register_op_strategy), as torch's own
layer_norm does: the public register_sharding keys its cache without normalized_shape and output_mask, and
their values change the answer.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

from torch_ln._transforms import OPS, OpInfo


def _strategy(info: OpInfo, op_schema: OpSchema) -> OpStrategy:
    op = op_schema.op
    # Arguments left at their schema defaults (trailing ones) are not in args_schema.
    names = [a.name for a in op._schema.arguments][: len(op_schema.args_schema)]
    args = dict(zip(names, op_schema.args_schema))
    returns = len(op._schema.returns)
    # Backward ops: outputs are the row gradients then one gradient per param, each produced only if output_mask
    # says so.
    mask = args.get("output_mask", [True] * returns)
    param_outputs = (
        [bool(mask[info.row_grads + i]) and args[p] is not None for i, p in enumerate(info.params)]
        if "output_mask" in args
        else []
    )
    row_outputs = [bool(m) for m in mask[: returns - len(param_outputs)]]
    axis = args[info.rows[0]].ndim - len(args["normalized_shape"])

    def placements(rows, params_reduced) -> list:
        # An output not produced is an empty (0,) tensor: replicated.
        outputs = [rows if produced else Replicate() for produced in row_outputs]
        outputs += [params_reduced if produced else Replicate() for produced in param_outputs]
        # An absent optional row (grad_residual_out=None) has no placement.
        inputs = [
            (rows if name in info.rows else Replicate()) if isinstance(args[name], OpStrategy) else None
            for name in names
        ]
        return outputs + inputs

    strategies = [placements(Replicate(), Replicate())]
    strategies += [placements(Shard(dim), Partial("sum")) for dim in range(axis)]
    return expand_to_full_mesh_op_strategy(op_schema.get_mesh_from_args(), op_schema, strategies, input_index=returns)


def _register() -> None:
    for name, info in OPS.items():
        op = getattr(torch.ops.torch_ln, name).default
        # Every argument from normalized_shape on is part of the cache key (the first argument's shape already is).
        register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=1))(
            lambda op_schema, info=info: _strategy(info, op_schema)
        )


_register()
