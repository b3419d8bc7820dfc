"""CODA's graph rewrites: transformer glue moved into the epilogues of the matmuls around it.

One rule per file, each a pure Graph -> Graph function returning its input unchanged when it
does not fire. The order matters: gate/up interleaving first (so RMSNorm folds γ into the
interleaved weight once), then the norms into the matmuls they feed, then residual adds into
the matmuls that produce their other operand, then maps above the row reshapes that separate
them from a matmul (GPT-2's Conv1D).

compiler.compile_stages runs them (with `run_coda`) whenever it plans generated GEMMs, whose
epilogues take what they leave behind: row scales, pairwise ops, residual tiles.
"""
from __future__ import annotations

from ..rewrites import Fired, run_rewrites
from .glu_interleave import interleave_glu
from .layernorm_matmul import layernorm_into_matmul
from .residual_epilogue import residual_into_epilogue
from .rmsnorm_matmul import rmsnorm_into_matmul
from .row_views import maps_before_row_views

CODA_RULES = (interleave_glu, rmsnorm_into_matmul, layernorm_into_matmul, residual_into_epilogue,
              maps_before_row_views)


def run_coda(g, rules=CODA_RULES) -> tuple[object, list[Fired]]:
    """Apply the CODA rules in order; returns the graph and the (rule, before, after) trail."""
    return run_rewrites(g, rules)


__all__ = ["CODA_RULES", "run_coda", "interleave_glu", "rmsnorm_into_matmul", "layernorm_into_matmul",
           "residual_into_epilogue", "maps_before_row_views"]
