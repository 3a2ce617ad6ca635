"""The `tiergate` command line."""
