"""grouped_delta's block sizes: tl.dot needs 16 on every side; a decode row pads its row block."""

BLOCK_ROWS = 16  # rows of one slot per program (a decode step's slot has one row a sequence)
BLOCK_RANK = 32  # rank rows per shrink program and per expand loop step
BLOCK_K = 64  # shrink: inputs per loop step
BLOCK_N = 64  # expand: output columns per program
