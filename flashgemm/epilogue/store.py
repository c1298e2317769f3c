"""The plain epilogue: each tile's valid rows into ``out`` (bulk tensor
stores for full tiles, row pieces below m_e for an expert's last m-block),
with the completion signals when asked."""

from .base import COMBINE_ONLY, EpilogueOp

STORE = EpilogueOp(name="store", family="store", signals=True, ptx_forbidden=COMBINE_ONLY)
