"""Native CPU kernels, compiled on first use with torch's C++ extension loader (see native.py)."""
