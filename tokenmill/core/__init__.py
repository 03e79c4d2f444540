"""Scheduling and KV block bookkeeping. Pure Python: this package must never import torch."""
