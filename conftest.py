"""Repository-level pytest setup: puts the repo root on sys.path (for ``examples``)."""
