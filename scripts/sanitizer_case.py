"""A small CUDA workload for compute-sanitizer: every kernel family and layout, once each, plain, fused and gated."""

import torch

import torch_ln

torch.manual_seed(0)
# (rows, D, dtype): short rows, warp rows, block rows, rows in one block's shared memory and over clusters, scalar
# path, mixed precision.
CASES = [
    (37, 7, torch.float32),
    (64, 256, torch.bfloat16),
    (33, 1024, torch.float32),
    (9, 4096, torch.float16),
    (5, 9001, torch.float32),
    (3, 40000, torch.bfloat16),
    (17, 768, torch.float64),
    (3, 16392, torch.float32),  # forward: one block's shared memory; backward: a cluster of 2
    (2, 131072, torch.bfloat16),  # clusters of 4-16 blocks: distributed shared memory
    (2, 262144, torch.float32),  # forward cluster of 16; backward LayerNorm reads the row twice
]
for rows, cols, dtype in CASES:
    # Mixed precision: float32 parameters and residual stream beside 16-bit inputs.
    dtypes = {dtype, torch.float32} if dtype in (torch.float16, torch.bfloat16) else {dtype}
    for weight_dtype in dtypes:
        x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
        w = torch.randn(cols, device="cuda", dtype=weight_dtype, requires_grad=True)
        b = torch.randn(cols, device="cuda", dtype=weight_dtype, requires_grad=True)
        torch_ln.layer_norm(x, [cols], w, b).sum().backward()
        torch_ln.rms_norm(x, [cols], w).sum().backward()
        # The fused residual add.
        residual = torch.randn_like(x)
        for residual_dtype in dtypes:
            y, h = torch_ln.add_layer_norm(x, residual, [cols], w, b, residual_dtype=residual_dtype)
            (y.sum() + h.sum()).backward()
            y, h = torch_ln.add_rms_norm(x, residual, [cols], w, residual_dtype=residual_dtype)
            (y.sum() + h.sum()).backward()
        # Quantized outputs (inference): the forward kernels' quantizing epilogue, per token, per group (reduced over
        # warp lanes; a second kernel where the groups do not fit them) and static.
        with torch.no_grad():
            group = 128 if cols % 128 == 0 else 1
            torch_ln.rms_norm_quant(x, [cols], w)
            torch_ln.add_rms_norm_quant(x, residual, [cols], w, group_size=group, return_unquantized=True)
            torch_ln.layer_norm_quant(x, [cols], w, b, scale=torch.ones(1, device="cuda"), out_dtype=torch.int8)
        # The gated RMSNorm (its GATED instances): the gate before the norm over groups (each block one group's rows),
        # and after it, ungrouped.
        z = torch.randn_like(x, requires_grad=True)
        group = cols // 4 if cols % 4 == 0 else None
        torch_ln.gated_rms_norm(x, z, cols, w, gate_position="before", group_size=group).sum().backward()
        torch_ln.gated_rms_norm(x, z, cols, w, gate_position="after", activation="sigmoid").sum().backward()
        # An unaligned view: the scalar path.
        torch_ln.layer_norm(x.detach().flatten()[1:].view(-1)[: (rows - 1) * cols].view(rows - 1, cols), [cols])
torch.cuda.synchronize()
print("sanitizer case done")
