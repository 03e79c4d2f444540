"""Benchmarks shipped with the product: `tokenmill bench latency | throughput | serve`."""
