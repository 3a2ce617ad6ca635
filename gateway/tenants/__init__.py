"""Tenants, their plans and their API keys."""
