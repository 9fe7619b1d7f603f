"""The plan: which trainer tensor goes where, in what format, in which bucket; computed once.

``types`` (targets, destinations, params, shards: what an engine reports), ``eligibility``
(which tensors are quantized), ``shapes`` (model shapes and HF tensor specs), ``dtypes``
(dtype names on the wire) and ``build`` (``RefitPlan`` from both sides' tables).
"""
