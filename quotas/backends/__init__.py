"""Quota state backends: memory (one process, embedded) and Redis (shared by replicas)."""
