"""The numba-cuda GPU backend: kernels (one module per op family, each with a NumPy twin
in executor/reference/ops.py), cuBLASLt GEMMs, the device state pool and the backend.
The only package that imports numba.cuda."""
