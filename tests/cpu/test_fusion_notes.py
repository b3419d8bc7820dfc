"""What the plan says about the steps it leaves to PyTorch."""
import torch

import tilefuse
from tilefuse import models


def test_the_permute_back_of_attentions_output_is_noted_as_free_where_sdpa_lays_it_out_so():
    """A Llama's attention output permuted back to [B, S, H, D] before the O projection is a
    copy in PyTorch only where SDPA did not lay it out that way; the plan's note says so (it
    said "permute copy in PyTorch", which cuDNN's layout makes nothing)."""
    m = models.llama(256, 1, 512, 1024, 8, max_seq=64).to(torch.bfloat16).eval()
    prog = tilefuse.compile(m, [torch.randint(0, 256, (2, 16))])
    notes = [s.note for s in prog.plan.steps if s.family == "extern" and s.nodes[0].startswith("permute")]
    assert any(n.startswith("permute of attention's output: free where SDPA lays it out [B, S, H, D]") for n in notes), notes
