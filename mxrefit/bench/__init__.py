"""The refit benchmark: ``mxrefit bench`` (see ``mxrefit.bench.run``)."""
