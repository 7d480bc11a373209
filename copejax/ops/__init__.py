"""Array operations shared by position schemes: scans, interpolation, blockwise kernels."""
