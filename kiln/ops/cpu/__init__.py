"""kiln's own CPU kernels: C++ built with torch's cpp_extension by kiln prewarm, kept in the cache root."""
