"""gpusolver."""
