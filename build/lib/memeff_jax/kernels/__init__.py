"""Building blocks below both ops: Hopper (Mosaic GPU) helpers and the Mosaic GEMM."""
