"""Tolerances of the parity tests, from an error model and not from one machine's kernels.

Two computations of the same math in floating point differ when their sums run in another order:
another tensor-parallel split (partial sums all-reduced), another batch size (another matmul blocking),
another CPU (AVX2 and AVX-512 kernels block and vectorize differently), chunked prefill. The model:

    a sum of n terms rounded in precision u is off by about u * sqrt(n) * |terms| (rounding errors of a
    long sum behave like a random walk; the worst case is n * u); two orders of the same sum differ by
    at most twice that; a network of `depth` such layers, each of gain about one (normed, residual),
    adds their errors. `SAFETY` covers the non-random part (correlated roundings, a few large terms).

So `reordered(dtype, terms=n, depth=d, like=reference)` gives rtol = atol / scale with
atol = 2 * SAFETY * d * sqrt(n) * u * scale, scale being the largest magnitude of the reference output.
A comparison that must be bitwise uses `BITWISE`, and is made bitwise by construction (the same kernels
on the same shapes in the same order), never by a tight tolerance.

Parity against the reference libraries (transformers, diffusers, LeRobot) keeps each test's stated
tolerance: `against(library, ...)` names it and the reason it holds on every CPU, measured on AVX-512
and on AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2`,
the kernels a CPU without AVX-512 gets; `make test-avx2` runs the parity tests so).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import torch

SAFETY = 4.0

UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}


class Tolerance(Mapping):
    """`rtol` and `atol` for `torch.testing.assert_close(got, want, **tol)`, with the reason they hold."""

    def __init__(self, rtol: float, atol: float, why: str) -> None:
        if not why:
            raise ValueError("a tolerance states why it holds")
        self.rtol, self.atol, self.why = float(rtol), float(atol), why

    def __getitem__(self, key: str) -> float:
        return {"rtol": self.rtol, "atol": self.atol}[key]

    def __iter__(self) -> Iterator[str]:
        return iter(("rtol", "atol"))

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"Tolerance(rtol={self.rtol:.3g}, atol={self.atol:.3g}: {self.why})"


BITWISE = Tolerance(0, 0, "the same kernels on the same shapes in the same order: equal bit for bit")


def reordered(dtype: torch.dtype, *, terms: int, depth: int = 1, like: Any = None, scale: float | None = None
              ) -> Tolerance:
    """Two computations of the same `depth`-layer math in `dtype` whose sums of up to `terms` terms run in
    another order; `like` (the reference output) or `scale` sets the magnitude atol is relative to."""
    u = UNIT_ROUNDOFF[dtype]
    if scale is None:
        scale = 1.0 if like is None else max(float(torch.as_tensor(like).detach().abs().max()), 1e-30)
    rtol = 2 * SAFETY * depth * math.sqrt(terms) * u
    return Tolerance(rtol, rtol * scale, f"{dtype} sums of {terms} terms over {depth} layers in another order "
                                        f"(scale {scale:.3g})")


# Parity with the reference libraries: each test's stated tolerance, and why it holds on every CPU.
_LIBRARIES = {
    # transformers: log-probs of the same greedy tokens; the paged runtime reads the KV cache in blocks and
    # chunks prefill, transformers runs one dense forward (another order of every attention sum); a log-prob
    # is a log-softmax over the vocabulary, so errors of ~1e-6 in fp32 logits stay far below 1e-4.
    ("transformers", "log_probs"): (0, 1e-4, "fp32 log-probs over paged blocks and chunked prefill vs one dense "
                                             "forward; holds on AVX-512 and AVX2 kernels"),
    # diffusers: a request alone runs the pipeline's own modules on the same shapes; what differs is the
    # engine's batching of the scheduler's arithmetic and of the VAE decode (the same ops, split per request).
    ("diffusers", "alone"): (0, 1e-6, "the pipeline's own modules on the same shapes; outputs of ~1 differ "
                                      "in the last bits at most, on AVX-512 and AVX2 kernels"),
    # batched with other requests (or with classifier-free guidance split over ranks): matmuls over another
    # batch size block their sums differently; latents and videos are of ~1.
    ("diffusers", "batched"): (0, 1e-5, "batched or CFG-split: matmuls over another batch size sum in another "
                                        "order on outputs of ~1; holds on AVX-512 and AVX2 kernels"),
    # LeRobot: action chunks of flow policies over 10 denoising steps, batched with other robots or alone;
    # LeRobot's own batched call differs from its unbatched one by the same amount.
    ("lerobot", "chunks"): (1e-5, 1e-5, "flow-policy action chunks over 10 Euler steps in another batch; "
                                        "LeRobot's own batched call differs from its lone call as much"),
    # The project's own flow policy against its unbatched reference forward.
    ("flow_policy", "chunks"): (1e-5, 1e-5, "flow-matching action chunks batched vs alone: another batch size "
                                            "sums in another order over the denoising steps"),
    # sentence-transformers (MiniLM): embeddings of unit norm, padded vs unpadded batches.
    ("sentence_transformers", "embeddings"): (0, 1e-4, "unit-norm embeddings from padded batches vs the library's "
                                                       "own padding; BERT's sums of 384 terms over 6 layers"),
}


def against(library: str, case: str) -> Tolerance:
    """The stated tolerance of a parity test against `library` (see the table above for each reason)."""
    try:
        rtol, atol, why = _LIBRARIES[(library, case)]
    except KeyError:
        raise KeyError(f"no stated tolerance for {library!r} / {case!r}; known: {sorted(_LIBRARIES)}") from None
    return Tolerance(rtol, atol, f"{library}: {why}")
