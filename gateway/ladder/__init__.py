"""The degradation ladder: declared levels, automatic triggers, on-call overrides, an audit trail."""
