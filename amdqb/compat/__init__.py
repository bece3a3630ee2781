"""The peers' own module surfaces as thin translations onto amdqb's ops, so that switching a code
path to amdqb is an import change:

* ``amdqb.compat.te``: TransformerEngine's ``transformer_engine.pytorch.router``.
"""
