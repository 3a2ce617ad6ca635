"""HTTP routes, grouped by feature."""
