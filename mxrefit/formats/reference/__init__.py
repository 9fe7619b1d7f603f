"""Independent reference quantizers (float64 / exhaustive-table oracles) and adversarial input
suites. Not used by a refit: the tests and the GPU parity scripts in scripts/ check the kernels
against them, so they live in one place both can import."""
