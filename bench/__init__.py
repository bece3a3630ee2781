"""amdqb benchmark library (``amdqb bench ...`` / ``python -m amdqb bench ...``)."""
