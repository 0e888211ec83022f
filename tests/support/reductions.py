"""Logits of two models that compute the same function from weights of different shapes: the padded output
(zero rows and columns added) and the unpadded one. Their weights are compared bit for bit elsewhere; their
logits agree only to within the rounding of the reductions, so they are compared with a tolerance.

Why: a padded Linear reduces over more columns, zeros, which add nothing; but the sum is blocked and
ordered differently, and how depends on the CPU's vector unit (ATen's DEFAULT, AVX2 and AVX-512 kernels,
oneDNN's AMX). A bf16 model rounds every layer's float32 sums to bf16, so a sum near a rounding boundary
moves by one bf16 step, and that step carries on through the layers. The same weights in the same shapes
run the same kernels in the same order on every host: those logits are compared bit for bit.

Measured (tests/model/test_families_independent.py::test_block_padded at --pad-for-tp 4,
tests/plan/test_padding_families.py, tests/cli/test_engines.py, run with ATEN_CPU_CAPABILITY=avx2 and =default on an
AVX2 host): at most 0.0039 with a largest |logit| of 1.07 (0.37 %, one bf16 step), in 16 to 179 of 2,304
to 2,400 logits; most models agree exactly.
"""

from __future__ import annotations

import torch

PADDED_LOGITS_TOL = 2**-6  # of the largest |logit|: 1.6 %, about four times the largest difference measured


def assert_same_function(padded: torch.Tensor, plain: torch.Tensor) -> None:
    """The padded model's logits are the unpadded model's, to within PADDED_LOGITS_TOL of the largest."""
    assert padded.shape == plain.shape, (tuple(padded.shape), tuple(plain.shape))
    largest = float(plain.abs().max())
    assert largest > 0, "all-zero logits compare nothing"
    diff = float((padded.float() - plain.float()).abs().max())
    assert diff <= PADDED_LOGITS_TOL * largest, f"logits {diff:.4g} apart, over {PADDED_LOGITS_TOL} x {largest:.4g}"
