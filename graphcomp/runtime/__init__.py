"""graphcomp runtime: CUDA-graph runners, memory pool and teardown."""
