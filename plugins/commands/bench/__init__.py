"""Benchmarks: workloads, our engine timed, transformers and llama.cpp baselines, reports."""
