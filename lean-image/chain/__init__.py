"""Reading a chained image: each region's chain folded once, so the work per page does not
grow with the chain's depth (spec §10; spec/guides/architecture.md, "…and back").

- resolution.py:    resolve: the links' own pages folded into per-page arrays (Resolution):
                    each page's base, its deltas, its digest link;
- deltas.py:        delta folding for a forward pass: the DELTA_FRAMEs that apply read,
                    parsed and folded on the read-ahead workers in batches (ChainPatches),
                    begun while the chain is resolved (parse_deltas_ahead);
- forward.py:       the forward pass: each PAGE_FRAME decompressed once, live pages carried
                    (StoredPages); the frames a range reads, read ahead (FrameWindow);
- random_access.py: random reads' deltas, a DELTA_FRAME at a time as word patches (DeltaPatches);
- build.py:         a range built into one buffer (fill) and checked (check_built);
- region_pieces.py: a range as verified runs, views of decompressed frames where it can (pieces).
"""

from .deltas import parse_deltas_ahead
from .build import check_built, fill
from .region_pieces import pieces
from .resolution import Resolution, resolve

__all__ = ["Resolution", "check_built", "fill", "parse_deltas_ahead", "pieces", "resolve"]
