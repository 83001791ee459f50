"""lora_delta's measured choice."""

# From this many delta rows on, gathering them for two tensor-core GEMMs beats the per-row kernel, whose
# recompute of x[row] A^T costs N/256 * K * r FMAs a row. Re-measure: python bench/clef.py
LORA_GEMM_ROWS = 16
