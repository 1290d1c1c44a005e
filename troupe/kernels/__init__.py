"""Kernels: one op per module, each with a plain-torch reference (`attention`: paged attention)."""
