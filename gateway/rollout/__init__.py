"""Model versions of a tier rolled out in steps: state, assignment, and the service that changes them."""
