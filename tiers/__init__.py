"""tiers package."""
