"""Transport: the token-checked control channel and the persistent transfer buffers (import the submodules)."""
