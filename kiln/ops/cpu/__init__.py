"""kiln's own CPU kernels: C++ (paged attention, RMSNorm) built with torch's cpp_extension by kiln
prewarm and kept in the cache root, and bf16 linear weights prepacked for oneDNN at load."""
