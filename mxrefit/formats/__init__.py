"""Wire formats: how a trainer tensor is encoded in the transfer buffer (MXFP8, BF16)."""
