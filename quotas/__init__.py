"""quotas package."""
