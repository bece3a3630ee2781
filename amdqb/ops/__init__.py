"""Public ops: each validates its arguments, asks ``amdqb.dispatch`` for a backend, and launches."""
