"""fp8 engines with block scales through a real refitd, from Python: a bf16 trainer buffer into
an fp8 destination (torch.uint8 storage, refit_dtype=FP8_E4M3: Debian's torch 1.13 has no float8
dtypes) with [128, 128] block scales in an FP32 `weight_scale_inv` tensor, TP shards of both,
and a diverged (NaN) version the engine refuses by Status. Bytes are checked against a reference
of the rule written here (docs/api.md "Engines")."""

import itertools
import sys
import unittest

import torch

import refit
from daemons import DaemonCase
from refit.v1 import refit_pb2

_models = itertools.count()

# Every non-negative finite e4m3fn value, by code (0x00 .. 0x7e).
_E4M3 = []
for code in range(0x7f):
    exponent, mantissa = code >> 3, code & 7
    _E4M3.append(mantissa / 8 * 2.0 ** -6 if exponent == 0
                 else (1 + mantissa / 8) * 2.0 ** (exponent - 7))
_E4M3_VALUES = torch.tensor(_E4M3, dtype=torch.float64)


def e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn codes: round to nearest, ties to the even code, saturating at 448."""
    a = y.double().abs().clamp(max=448.0)
    hi = torch.bucketize(a, _E4M3_VALUES).clamp(max=0x7e)  # first value >= a
    lo = (hi - 1).clamp(min=0)
    d_hi = _E4M3_VALUES[hi] - a
    d_lo = a - _E4M3_VALUES[lo]
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    code = torch.where(torch.signbit(y), code | 0x80, code)
    code = torch.where(torch.isnan(y), torch.tensor(0x7f), code)
    return code.to(torch.uint8)


def reference(x: torch.Tensor, block=(128, 128)):
    """(codes, scales) of a 2-D float tensor with the rule, block by block in fp32."""
    x = x.float()
    rows, cols = x.shape
    br, bc = block
    gr, gc = -(-rows // br), -(-cols // bc)
    scales = torch.empty(gr, gc, dtype=torch.float32)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    for i in range(gr):
        for j in range(gc):
            b = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = b.abs().max() if not torch.isnan(b).any() else torch.tensor(float("nan"))
            s = torch.tensor(1.0) if amax == 0 else amax / torch.tensor(448.0)
            scales[i, j] = s
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = e4m3(b / s)
    return codes, scales


class Fp8Test(DaemonCase):
    def fp8_rank(self, model, name, shape, rank, ranks, block=(128, 128)):
        """Destination rank `rank` of `ranks` (rows): its fp8 rows and its rows of the scales."""
        rows = shape[0] // ranks
        grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        grid_rows = grid[0] // ranks
        weight = refit.Slice(global_shape=shape, offsets=(rank * rows, 0),
                             sizes=(rows, shape[1]), dtype=torch.uint8,
                             refit_dtype=refit_pb2.FP8_E4M3,
                             scale_tensor=name + "_scale_inv", scale_block=block)
        scale = refit.Slice(global_shape=grid, offsets=(rank * grid_rows, 0),
                            sizes=(grid_rows, grid[1]), dtype=torch.float32)
        return self.register(model, refit.DESTINATION,
                             {name + "_scale_inv": scale, name: weight})

    def test_tp2_fp8_engine_from_bf16_trainer(self):
        model = f"fp8-{next(_models)}"
        name = "model.layers.0.mlp.down_proj.weight"
        w = (torch.randn(512, 384, generator=torch.Generator().manual_seed(1)) * 0.02)
        w = w.to(torch.bfloat16)
        src = self.register(model, refit.SOURCE, {name: w})
        ranks = [self.fp8_rank(model, name, (512, 384), r, 2) for r in range(2)]
        self.client.publish(model, 1, [src])
        self.assertEqual(self.client.wait_for_version(model, 1, timeout=10), 1)
        self.client.apply(model, ranks, 1)
        codes, scales = reference(w)
        for r, buf in enumerate(ranks):
            self.assertTrue(torch.equal(buf.tensors[name], codes[r * 256:(r + 1) * 256]), r)
            got = buf.tensors[name + "_scale_inv"]
            self.assertTrue(torch.equal(got.view(torch.int32),
                                        scales[r * 2:(r + 1) * 2].view(torch.int32)), r)
        status = self.client.status()
        mine = [m for m in status.models if m.model == model][0]
        self.assertEqual(mine.latest_nonfinite_values, 0)

    def test_shard_through_a_block_is_refused(self):
        model = f"fp8-{next(_models)}"
        with self.assertRaises(refit.InvalidArgumentError):
            self.fp8_rank(model, "w", (384, 256), 0, 3)  # 128-row ranks: fine
            self.fp8_rank(model, "v", (256, 256), 0, 2, block=(96, 128))  # 128 rows cut 96s

    def test_diverged_version_counted_and_refusable(self):
        model = f"fp8-{next(_models)}"
        w = torch.randn(256, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        w[3, 4] = float("nan")
        w[200, 7] = float("inf")
        src = self.register(model, refit.SOURCE, {"w": w})
        dst = self.fp8_rank(model, "w", (256, 256), 0, 1)
        self.client.publish(model, 1, [src])
        self.client.wait_for_version(model, 1, timeout=10)
        mine = [m for m in self.client.status().models if m.model == model][0]
        self.assertEqual(mine.latest_nonfinite_values, 2)  # an engine would refuse here
        self.client.apply(model, [dst], 1)  # quantized by the rule all the same
        codes, scales = reference(w)
        self.assertTrue(torch.equal(dst.tensors["w"], codes))
        got = dst.tensors["w_scale_inv"]
        self.assertTrue(torch.isnan(got[0, 0]) and torch.isinf(got[1, 0]))
        self.assertTrue(torch.equal(got[0, 1:].view(torch.int32), scales[0, 1:].view(torch.int32)))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]])
