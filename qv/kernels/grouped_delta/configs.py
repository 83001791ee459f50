"""grouped_delta's block sizes (tl.dot needs 16 on every side). Few rows a slot (decode: one a sequence):
small row blocks, the launch is a read of the slots' A and B. Many (a prompt chunk, a Clef record): larger
row and rank blocks, so each A and B tile is re-read by fewer row blocks (the grid runs a slot's row
blocks next to each other, sharing the tile in L2). Re-measure: python bench/clef.py"""

MANY_ROWS = 128  # from this many rows in one slot, the large blocks
# (rows of one slot per program, rank rows per shrink program and expand step, shrink K step, expand columns)
FEW = (16, 32, 64, 64)
MANY = (64, 64, 64, 128)
NO_DOT = (16, 16, 16, 32)  # sm_70 (no tl.dot): [BM, BR, BK] and [BM, BR, BN] products live in registers
