"""Device smoke check: CuTeDSL compiles and runs a kernel that writes packed scale offsets."""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Uint8
from moe_mxfp8.kernels.common import packed_scale_offset, to_cute
from moe_mxfp8.kernels.native import cu_stream, current_stream

from moe_mxfp8 import layout


@cute.kernel
def _write_offsets(out: cute.Tensor, nb: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    if tidx < nb:
        out[packed_scale_offset(bidx, tidx, nb)] = Uint8((bidx * 7 + tidx) % 251)


@cute.jit
def _launch(out: cute.Tensor, nb: Int32, rows: Int32, stream):
    _write_offsets(out, nb).launch(grid=[rows, 1, 1], block=[32, 1, 1], stream=stream)


rows, nb = 300, 7
out = torch.full((layout.packed_scale_bytes(rows, nb),), 0xAB, dtype=torch.uint8, device="cuda")
stream = cu_stream(current_stream(out.device))
fn = cute.compile(_launch, to_cute(out), Int32(nb), Int32(rows), stream)
fn(to_cute(out), Int32(nb), Int32(rows), stream)
torch.cuda.synchronize()
dense = (torch.arange(rows)[:, None] * 7 + torch.arange(nb)[None, :]) % 251
got = layout.unpack_scales(out.cpu(), rows, nb)
print("cutedsl packed offsets match:", torch.equal(got, dense.to(torch.uint8)), cutlass.__file__)
