"""grouped_delta's block sizes (tl.dot needs 16 on every side). Few rows a slot (decode: one a sequence):
small row blocks, the launch is a read of the slots' A and B. Many (a prompt chunk, a Clef record): larger
row and rank blocks, so each A and B tile is re-read by fewer row blocks (the grid runs a slot's row
blocks next to each other, sharing the tile in L2). Re-measure: python bench/clef.py"""

from qv.kernels.triton_utils import interpreting

MANY_ROWS = 128  # from this many rows in one slot, the large blocks
# (rows of one slot per program, rank rows per shrink program and expand step, shrink K step, expand columns)
FEW = (16, 32, 64, 64)
MANY = (64, 64, 64, 128)
NO_DOT = (16, 16, 16, 32)  # sm_70 (no tl.dot): [BM, BR, BK] and [BM, BR, BN] products live in registers


def shrink_splits(max_rows: int, k: int, bk: int, device) -> int:
    """Parts the shrink's K is split into: few rows a slot (under MANY_ROWS) leave a grid of a few row blocks x
    the rank blocks, each looping over all of K (5,120-17,408 at 27B) on the device's latency; four parts give
    each program a quarter of K (partial t: 4 x rows x rank fp32, under 4.2 MiB at 127 rows). Under the CPU
    interpreter a K past one BK splits in two, so the tests cross a split. Re-measure: python bench/grouped_delta.py"""
    if max_rows >= MANY_ROWS:
        return 1
    if interpreting(device):
        return 2 if k > bk else 1
    return 4 if k >= 16 * bk else 1
