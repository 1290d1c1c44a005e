"""facades."""
